"""Models named by a Hugging Face Hub id (`Qwen/Qwen2.5-0.5B-Instruct`), found through the Hub's own
cache and download (`huggingface_hub.snapshot_download`, as transformers finds them): the cache under
HF_HOME when it holds the model (with HF_HUB_OFFLINE=1 only there: no network), else downloaded into
it where the network allows. Only the files a model directory needs are fetched: no duplicate
weights in other formats.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

# What the engine and the tokenizer read: configs, safetensors weights (with their index), tokenizer
# files and chat templates.
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja", "*.tiktoken"]


def is_hub_id(name: str) -> bool:
    """Whether `name` is written as a Hub model id, `organisation/name` (not a path: no leading /, . or ~)."""
    if name.count("/") != 1 or name.startswith(("/", ".", "~")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_snapshot(repo_id: str) -> Path:
    """The model directory of `repo_id` in the Hub cache, downloaded there first when the cache lacks it
    and the network is allowed. FileNotFoundError when neither can give it."""
    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILES))
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        raise FileNotFoundError(f"model {repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                                f"and {where}: download it there once (`hf download {repo_id}`), or give a "
                                f"model directory") from None
