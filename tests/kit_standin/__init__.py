"""A stand-in competition kit for tests: sweep/studies/script-demo/prepare.py copied into a folder with its data.

The stand-in lives beside the worked example's training script (sweep/studies/script-demo/train.py), which
uses it; this package builds copies of it for tests.

    root = build_kit(tmp / "kit", demo_dir, VOCAB_SIZE=512, EVAL_TOKENS=8 * 2048)
    # root/prepare.py, root/data/shard_0000{0..6}.parquet + shard_06542.parquet, root/tokenizer/

The data are the demo corpus's parquet shards (model.data.demo_text), the last one pinned as the kit's
validation shard, so the kit's split is the demo's. The tokenizer is trained by the copy's own
train_tokenizer(), or copied from another kit built from the same shards with the same VOCAB_SIZE
(`tokenizer_from`). Keyword arguments rewrite the copy's constants (MAX_SEQ_LEN, EVAL_TOKENS,
VOCAB_SIZE, ...): each must name a constant the file defines.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

PREPARE = Path(__file__).resolve().parents[2] / "sweep" / "studies" / "script-demo" / "prepare.py"
VAL_NAME = "shard_06542.parquet"  # the stand-in's VAL_FILENAME


def prepare_text(**constants: Any) -> str:
    """The stand-in's source with the named module constants set to the given values."""
    text = PREPARE.read_text(encoding="utf-8")
    for name, value in constants.items():
        text, n = re.subn(rf"^{name} = .*$", f"{name} = {value!r}  # set by tests/kit_standin", text, count=1,
                          flags=re.MULTILINE)
        if n != 1:
            raise KeyError(f"prepare.py defines no constant {name}")
    return text


def import_prepare(path: Path) -> ModuleType:
    """A kit's prepare.py imported under a name of its own (as model.data.kit does, but not shared with it)."""
    name = "standin_kit_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_kit(root: Path, demo_dir: Path, tokenizer_from: Path | None = None, **constants: Any) -> Path:
    """A kit folder at `root` (see the module doc); returns root."""
    root.mkdir(parents=True)
    (root / "prepare.py").write_text(prepare_text(**constants), encoding="utf-8")
    kit = import_prepare(root / "prepare.py")
    kit.fill_data(str(demo_dir))
    if tokenizer_from is not None:
        shutil.copytree(Path(tokenizer_from) / "tokenizer", root / "tokenizer")
    else:
        kit.train_tokenizer()
    return root
