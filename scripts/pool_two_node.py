"""Run `postrl train` with the rollout pool on a local two-node Ray cluster (issue 35's check), on one machine.

Two raylets (ray.cluster_utils.Cluster): a head node 'trainer_node' (--trainer-cpus, where this process is
the driver and the trainer runs) and a node 'rollout_node' (--rollout-cpus, custom resource
rollout_node: 2). The pool's replicas are pinned to the second node by rollout.pool.resources; the
trainer reaches the cluster through cluster.ray_address. Afterwards it prints where the driver and each
replica actor ran (from the GCS: node id and that node's resources), writes them to
<logging.dir>/placement.json, and stops only this cluster's processes (not every Ray on the machine,
as `ray stop` would).

  OMP_NUM_THREADS=1 python scripts/pool_two_node.py configs/tiny_dapo.yaml rollout.placement=pool \
      rollout.pool.replicas=2 rollout.max_staleness=1 logging.dir=/tmp/pool_two_node
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def summarise(metrics: Path, k: int) -> None:
    """Held-out accuracy at each validation and every batch's staleness, from the run's metrics.jsonl."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    for r in rows:
        accs = {key: v for key, v in r.items() if key.startswith("val/") and key.endswith("/acc_mean@1")}
        if accs:
            print(f"step {r.get('step')}: " + ", ".join(f"{key} {100 * v:.1f}%" for key, v in accs.items()))
    batches = [r for r in rows if "async/staleness_max" in r]
    means = [r["async/staleness_mean"] for r in batches]
    worst = max(r["async/staleness_max"] for r in batches)
    dropped = sum(r.get("async/dropped_stale_groups", 0) for r in batches)
    print(f"{len(batches)} batches: staleness mean {sum(means) / len(means):.2f}, max {worst} (bound {k}), "
          f"{dropped} group(s) dropped, replicas alive at the end {batches[-1].get('rollout_pool/replicas_alive')}")  # fmt: skip
    assert worst <= k, f"a batch was {worst} updates behind, over the bound {k}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainer-cpus", type=int, default=1)
    ap.add_argument("--rollout-cpus", type=int, default=2)
    ap.add_argument("--object-store-mb", type=int, default=300)
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="config and overrides for `postrl train`")
    args = ap.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    # Cluster records its address in /tmp/ray/ray_current_cluster, where any ray.init() on this machine
    # would find and join it: put back what was there (the trainer gets the address explicitly).
    address_file = Path("/tmp/ray/ray_current_cluster")
    before = address_file.read_text() if address_file.exists() else None
    store = args.object_store_mb * 1024 * 1024
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.trainer_cpus, "resources": {"trainer_node": 1},
                                                            "include_dashboard": False, "object_store_memory": store})  # fmt: skip
    cluster.add_node(num_cpus=args.rollout_cpus, resources={"rollout_node": args.rollout_cpus}, object_store_memory=store)
    if address_file.exists() and address_file.read_text().strip() == cluster.address:
        if before is None:
            address_file.unlink()
        else:
            address_file.write_text(before)
    print(f"two-node Ray cluster at {cluster.address}", flush=True)
    from postrl.checks import load_config
    from postrl.cli import main as postrl_main

    overrides = [f"cluster.ray_address={cluster.address}", "rollout.pool.resources={rollout_node: 1}"]
    train_args = [a for a in args.train_args if a != "--"]
    try:
        rc = postrl_main(["train", *train_args, *overrides])
        if not ray.is_initialized():
            ray.init(address=cluster.address, log_to_driver=False)
        nodes = {n["NodeID"]: {k: v for k, v in n["Resources"].items() if k.endswith("_node")} for n in ray.nodes()}
        placement = {"driver": {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}, "actors": []}
        for actor in ray._private.state.actors().values():
            placement["actors"].append({"class": actor["ActorClassName"], "state": actor["State"], "node": actor["Address"]["NodeID"], "pid": actor["Pid"]})
        for row in [placement["driver"], *placement["actors"]]:
            row["node_resources"] = nodes.get(row["node"], {})
        print(json.dumps(placement, indent=1), flush=True)
        cfg = load_config(train_args[0], [*train_args[1:], *overrides])
        run_dir = Path(cfg.logging.dir)
        (run_dir / "placement.json").write_text(json.dumps(placement, indent=1))
        replicas = [a for a in placement["actors"] if a["class"] == "Replica"]
        assert "trainer_node" in placement["driver"]["node_resources"], placement["driver"]
        assert replicas and all("rollout_node" in a["node_resources"] for a in replicas), replicas
        print(f"placement: the trainer on the head node (trainer_node), {len(replicas)} replica actor(s) on the rollout_node node")
        summarise(run_dir / "metrics.jsonl", cfg.rollout.max_staleness)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
