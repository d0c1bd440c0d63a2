"""Loading a saved model with its spans wherever ``transformers`` loads it.

``save_model`` calls :func:`write_loader`: the directory gets ``modeling_adaspan.py`` and
``config.json`` an ``auto_map`` naming its class, transformers' documented way for a directory
to bring its own loading code. ``AutoModelForCausalLM.from_pretrained(directory,
trust_remote_code=True)`` (and what calls it: ``pipeline``, lm-eval's ``HFLM``) then imports
that file, whose class loads the architecture ``config.json`` names with transformers' own
class and attaches the spans (``adaspan.hf.load_spans``). Without ``trust_remote_code``
transformers loads its own class alone, silently: :func:`watch_loading` (``import adaspan.hf``)
warns in one line at the first forward of such a model.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from weakref import WeakKeyDictionary

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook
from torch.utils.hooks import RemovableHandle
from transformers import PreTrainedModel

from .attention import NAME, span_modules

MODULE_FILE = "modeling_adaspan.py"
AUTO_MAP = {"AutoModelForCausalLM": "modeling_adaspan.AdaptiveSpanForCausalLM"}
HOW = ("load it with AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True) "
       "or adaspan.hf.load_pretrained(directory)")

# The file written beside the model: it runs in the user's process, so it names only adaspan's
# public functions, and stays valid across adaspan's versions.
MODULE = '''"""The causal LM of this directory with its learned attention spans (adaspan):
AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True) loads it through this
file, written by adaspan.hf.save_model. It needs adaspan: pip install 'adaspan[hf]'."""

from pathlib import Path

from adaspan.hf import load_spans
from adaspan.hf.spans import SETTINGS_FILE, SPANS_FILE
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import cached_file

HUB = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder",
       "token")


class AdaptiveSpanForCausalLM:
    """Not a model class: from_pretrained gives the model of transformers' own class for
    config.json, with the spans of adaptive_spans.safetensors attached."""

    @classmethod
    def register_for_auto_class(cls, auto_class: str | type = "AutoModelForCausalLM") -> None:
        """Called by transformers' auto classes on the class they load: nothing to record."""

    @classmethod
    def from_pretrained(cls, name: str | Path, *args: object, **kwargs: object
                        ) -> PreTrainedModel:
        """The model saved in ``name`` (a directory or a Hub repository), spans attached."""
        kwargs["trust_remote_code"] = False  # transformers' own class, not this one again
        model = AutoModelForCausalLM.from_pretrained(name, *args, **kwargs)
        hub = {key: kwargs[key] for key in HUB if key in kwargs}
        cached_file(name, SPANS_FILE, **hub)  # fetched beside the settings from a Hub repository
        return load_spans(model, Path(cached_file(name, SETTINGS_FILE, **hub)).parent)
'''


def write_loader(directory: str | Path) -> None:
    """Write ``MODULE_FILE`` in ``directory`` and name its class in ``config.json``'s
    ``auto_map``; a config that names other custom code (a model that is itself custom code)
    is left as it is."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    if set(config.get("auto_map", {}).items()) - set(AUTO_MAP.items()):
        return
    (Path(directory) / MODULE_FILE).write_text(MODULE)
    config["auto_map"] = AUTO_MAP
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


_unchecked: WeakKeyDictionary[nn.Module, RemovableHandle] = WeakKeyDictionary()


def watch_loading() -> None:
    """From now on, a ``transformers`` model built from a config that records spans (a
    directory of ``save_model``) is checked at its first forward: without spans attached,
    one warning says how to load it with them."""
    register_module_module_registration_hook(_watch)


def _watch(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    """Module registration hook: give a model whose config records spans a forward pre-hook
    (once), while it is being built."""
    if (isinstance(module, PreTrainedModel) and module not in _unchecked
            and getattr(getattr(module, "config", None), NAME, None)):
        _unchecked[module] = module.register_forward_pre_hook(_check)


def _check(model: nn.Module, args: tuple) -> None:
    """Forward pre-hook, first forward only: warn if ``model`` runs another attention than
    the spans' and has none attached (it was loaded without them)."""
    if model not in _unchecked:  # a copy made before its first forward: the original checks
        return
    for module in model.modules():  # the model and the models inside it: checked now
        if (handle := _unchecked.pop(module, None)) is not None:
            handle.remove()
    if model.config._attn_implementation != NAME and not span_modules(model):
        where = getattr(model.config, "_name_or_path", "") or "its directory"
        warnings.warn(f"the model of {where} was saved with learned attention spans "
                      f"(adaspan) that are not attached: {HOW}", stacklevel=2)
