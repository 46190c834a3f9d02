"""Training frameworks on :class:`~elastic_ext.worker.loop.ElasticLoop`: a Hugging Face
``TrainerCallback`` (:mod:`elastic_ext.integrations.huggingface`, extra
``transformers``) and a Lightning ``Callback`` (:mod:`elastic_ext.integrations.lightning`,
extra ``lightning``); ``resume`` holds what both need for their framework's resume path.
Each framework's module imports its framework, so import only the one you use."""
