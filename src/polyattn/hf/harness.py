"""lm-eval entry: the ``polyattn`` model of the LM Evaluation Harness, for saved `PolyattnForCausalLM` models.

lm-eval finds models only in its own registry, so this module registers ``polyattn`` (lm-eval's
`HFLM` over `AutoModelForCausalLM`, which ``import polyattn.hf`` taught the ``polyattn`` model type)
and then runs lm-eval's command line::

    python -m polyattn.hf.harness run --model polyattn --model_args pretrained=DIR --tasks NAME [--include_path TASKS]

(also installed as ``polyattn-lm-eval``). DIR holds the model and a tokenizer (`byte_tokenizer` for
byte-level models). Needs the ``eval`` extra.
"""

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import polyattn.hf  # noqa: F401  (registers model_type "polyattn" with the Auto classes)


@register_model("polyattn")
class PolyattnLM(HFLM):
    """`HFLM` with the causal backend, on CUDA when there is one (else the CPU)."""

    def __init__(self, pretrained, **kwargs):
        kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(pretrained=pretrained, backend="causal", **kwargs)

    @property
    def prefix_token_id(self):
        """HFLM's choice (``prefix_token_id=``, BOS, EOS); without any, the newline token, which separates
        documents in the ``text`` task's streams (byte-level models have no special tokens)."""
        token = super().prefix_token_id
        return self.tokenizer.encode("\n", add_special_tokens=False)[-1] if token is None else token


def main():
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
