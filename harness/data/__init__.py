"""The data pipeline: sources -> formats -> chat template -> tokenized samples -> mixing -> loaders."""
