"""stepguard inside training frameworks: one module per framework, each importing its framework
only when it is imported itself (``import stepguard`` never imports any of them).

- ``stepguard.integrations.deepspeed``: ``guard_engine(engine, ...)`` after
  ``deepspeed.initialize``;
- ``stepguard.integrations.megatron``: ``GuardedMegatronOptimizer`` around what
  ``get_megatron_optimizer`` returns;
- ``stepguard.integrations.lightning``: ``StepguardCallback`` for a ``lightning.Trainer``;
- ``stepguard.integrations.transformers``: ``StepguardCallback(...).attach(trainer)`` for a
  ``transformers.Trainer``;
- ``stepguard.integrations.torchtitan``: ``guarded(trainer_config, StepguardConfig(...))``, whose
  ``build()`` is a ``GuardedTrainer`` (torchtitan's Trainer, every step guarded).
"""
