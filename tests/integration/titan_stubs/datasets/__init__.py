"""Import-only stand-in for Hugging Face datasets (see ../README.md)."""


class Dataset:
    pass


class IterableDataset:
    pass


def load_dataset(*args, **kwargs):
    raise RuntimeError("the torchtitan CPU tests use a synthetic loader, not Hugging Face datasets")
