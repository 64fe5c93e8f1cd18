"""Why did my run go wrong: the engine-vs-trainer mismatch doctor and its statistics (docs/debugging.md).

    stats.py     pure tensor functions: the doctor's gap breakdowns (the per-step metrics are algorithms/mismatch.py's)
    replay.py    the HF engine's own log-probs of a batch (generate's computation: KV cache, eval mode, autocast)
    mismatch.py  `postrl doctor --mismatch`: one rollout batch, the trainer's log-probs of it, the report, the verdict
    verdict.py   rounding, stale weights, or a real difference (sampling parameters, template), with the fix
    report.py    the console tables and the JSON file

Nothing below the command line imports this package.
"""
