"""Prompts and training text: one record type (``Record``), one parser for every line form, one
way to find data sets (files, or named sets inside PyPI packages). Used by ``hispec generate
--prompts``, ``hispec bench --data`` and the exit-head tools (``train/sources.py``)."""
from .readers import iter_json_array, read_jsonl, read_prompts, read_sharegpt
from .records import DataError, Record, parse_record
from .sets import NAMED_SETS, iter_dataset, load_prompts, named_set_path, package_dir, select

__all__ = ["NAMED_SETS", "DataError", "Record", "iter_dataset", "iter_json_array", "load_prompts",
           "named_set_path", "package_dir", "parse_record", "read_jsonl", "read_prompts", "read_sharegpt", "select"]
