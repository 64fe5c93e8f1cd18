"""The trainer's record of the weights it published, against which every batch made elsewhere is checked:
each version's checksum (transport.checksum) travels with the weights, the rollout process recomputes it from
what it loaded and sends it back with the batch, so a missed or torn update is caught before it is trained on."""

from __future__ import annotations

from postrl.errors import UserError


class PublishedChecksums:
    """The checksum the trainer published as each version (two after a back-off to the best weights), kept
    while a batch may still carry that version: what a rollout process sampled with is checked against it."""

    def __init__(self, max_staleness: int):
        self.k = max_staleness
        self.sums: dict[int, set[float]] = {}

    def add(self, version: int, value: float) -> None:
        self.sums.setdefault(version, set()).add(value)
        for old in [v for v in self.sums if v < version - self.k - 1]:
            del self.sums[old]

    def verify(self, checksums: dict[int, float], who: str) -> None:
        """`who` (the rollout worker, a replica) sampled with `checksums` (version -> checksum of what it loaded)."""
        for version, value in checksums.items():
            if version in self.sums and value not in self.sums[version]:
                raise UserError(
                    f"{who} sampled with weights of version {version} whose checksum ({value!r}) differs from what the "
                    f"trainer published ({sorted(self.sums[version])}): a weight update was missed or torn. This is a bug "
                    "in postrl's weight transport; please report it with the run's config."
                )
