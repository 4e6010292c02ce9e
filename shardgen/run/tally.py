"""What one replica's batches made: the counts and seconds its throughput figures come from, and the stop when every
sample keeps failing (a broken setup, not bad prompts)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardgen.errors import UserError

MAX_FAILED_BATCHES = 3  # every sample of this many consecutive batches failing = a broken setup


class BrokenSetupError(UserError, RuntimeError):
    """Every sample keeps failing: stop instead of marking the whole run failed."""


@dataclass
class BatchTally:
    """Samples generated and the seconds their batches took, over every shard of this replica."""

    generated: int = 0      # pipeline outputs (a rejected row is recorded, not generated)
    gen_s: float = 0.0      # seconds of the batches, pipeline calls and their hand-over to the writer
    _failed_batches: int = field(default=0, init=False)  # consecutive batches whose every generated sample failed

    def count(self, made: list, elapsed: float) -> None:
        """Count one batch's samples ``made`` (rejected rows included) that took ``elapsed`` seconds, give each
        generated one its share of the time, and raise BrokenSetupError after ``MAX_FAILED_BATCHES`` batches in a
        row of only failures."""
        self.gen_s += elapsed
        generated = [s for s in made if s.status != "rejected"]
        for s in generated:  # the batch's time per generated sample, for the index (not the tar: see Sample.gen_s)
            s.gen_s = elapsed / len(generated)
        self.generated += len(generated)
        self._check_broken(generated)

    def _check_broken(self, generated: list) -> None:
        if generated and all(s.status == "failed" for s in generated):
            self._failed_batches += 1
            if self._failed_batches >= MAX_FAILED_BATCHES:
                raise BrokenSetupError(
                    f"every sample of the last {MAX_FAILED_BATCHES} batches failed, last with: {generated[-1].failure}. "
                    "Stopping so a broken setup does not mark the whole run failed; fix it and re-run the same "
                    "command (the failed samples are recorded; retry_failed=true regenerates them).")
        elif generated:
            self._failed_batches = 0
