"""Training frameworks on :class:`~elastic_ext.loop.ElasticLoop`: a Hugging Face
``TrainerCallback`` (:mod:`elastic_ext.integrations.huggingface`, extra
``transformers``). Each module imports its framework, so import only the one you use."""
