"""Import-only stand-in (see ../README.md)."""


def split_dataset_by_node(*args, **kwargs):
    raise RuntimeError("the torchtitan CPU tests use a synthetic loader")
