"""Hugging Face integration: `PolyattnConfig` and `PolyattnForCausalLM`, registered with `AutoConfig` and
`AutoModelForCausalLM` under ``model_type="polyattn"`` on import, and `PolyattnCache`.

```python
import polyattn.hf
from transformers import AutoConfig, AutoModelForCausalLM
model = AutoModelForCausalLM.from_config(AutoConfig.for_model("polyattn", mixer="kata-m2", vocab_size=256))
```
Needs the ``hf`` extra (``pip install "polyattn[hf]"``).
"""

try:
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError('polyattn.hf needs transformers: pip install "polyattn[hf]"') from error

from transformers import AutoConfig, AutoModelForCausalLM

from polyattn.hf.cache import MixerCacheLayer, PolyattnCache
from polyattn.hf.configuration import PolyattnConfig
from polyattn.hf.modeling import PolyattnForCausalLM, PolyattnPreTrainedModel

AutoConfig.register(PolyattnConfig.model_type, PolyattnConfig, exist_ok=True)
AutoModelForCausalLM.register(PolyattnConfig, PolyattnForCausalLM, exist_ok=True)

__all__ = ["MixerCacheLayer", "PolyattnCache", "PolyattnConfig", "PolyattnForCausalLM", "PolyattnPreTrainedModel"]
