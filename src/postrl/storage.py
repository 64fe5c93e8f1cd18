"""Is checkpoint.dir on storage every node sees? Checked once at the start of a multi-node run.

postrl writes a checkpoint as one directory (rank 0 the model, every rank its optimizer shard and RNG
state) and resumes by reading it back on every rank, so the directory must be shared by the nodes.
MindSpeed-RL's `no_shared_storage: true` instead keeps each node's ranks' files on that node; postrl
does not offer that: a run whose nodes do not share checkpoint.dir stops at start with the fix, not at
its first checkpoint or resume.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from postrl import distributed

MARK_DIR = ".postrl_shared_check"


def unshared_dir_problem(path: str | Path) -> str | None:
    """A message when some node cannot see a file another node wrote under `path` (collective: every rank calls it)."""
    world, local = distributed.world_size(), distributed.local_world_size()
    if world <= 1 or local >= world:
        return None  # one node: nothing to share
    nodes = world // local
    node, first_on_node = distributed.rank() // local, distributed.rank() % local == 0
    token = distributed.all_gather_object(uuid.uuid4().hex)[0]  # rank 0's, on every rank
    marks = Path(path) / MARK_DIR
    mine = marks / f"{token}.node{node}"
    if first_on_node:
        marks.mkdir(parents=True, exist_ok=True)
        mine.write_text(os.uname().nodename)
    distributed.barrier()
    unseen = [n for n in range(nodes) if not (marks / f"{token}.node{n}").exists()] if first_on_node else []
    reports = distributed.all_gather_object((node, os.uname().nodename, unseen))
    distributed.barrier()
    if first_on_node:
        mine.unlink(missing_ok=True)
    blind = [(n, host, u) for n, host, u in reports if u]
    if not blind:
        return None
    n, host, u = blind[0]
    return (
        f"checkpoint.dir ({path}) is not shared by the nodes: node {n} ({host}) does not see the files nodes "
        f"{', '.join(map(str, u))} wrote there. postrl saves one checkpoint directory that every rank writes to and "
        "resumes from, so the nodes must share it (MindSpeed-RL's no_shared_storage mode, each node keeping its own "
        "ranks' files, is not offered). Fix: point checkpoint.dir (or logging.dir) at a shared filesystem (NFS, "
        "Lustre, a mounted bucket), or train on one node."
    )
