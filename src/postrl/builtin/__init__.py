"""The demos' built-in models and tasks, kept out of the core.

- `tiny`: `builtin:tiny-qwen2` and `builtin:tiny-qwen2.5-vl`, random-initialised models with a
  tokenizer trained on the tasks below, built locally from a seed and cached (`model.path`).
- `arithmetic`: `builtin:arithmetic:<split>`, synthetic word problems (text).
- `shapes`: `builtin:shapes:<split>`, count the shapes in a picture, then add / take away (images).
- their settings, the `data.builtin.*` / `data.shapes.*` config sections, are postrl.config.knobs.
- `tasks`: `builtin:<task>:<split>` to a cached parquet file that the trainer reads like user data.
"""
