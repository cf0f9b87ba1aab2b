"""Training: schedules and losses (pure functions), the ``Trainer`` with exact resume,
checkpoints (``checkpoint.py``: model, optimizer, scheduler, step, config, RNG states, in
safetensors + JSON), distributed helpers and the toy tasks (``tasks/``).

Nothing is imported here: ``import attnlab.training.trainer`` loads only what it needs.
"""
