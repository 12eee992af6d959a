"""The data pipeline: sources -> formats -> chat template -> tokenized samples -> mixing -> loaders."""

IGNORE_INDEX = -100  # the label of positions the loss skips (torch cross_entropy's ignore_index)
