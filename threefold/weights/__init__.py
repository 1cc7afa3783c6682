"""Sources of logical tensors, read by region: only the slices a rank owns leave the file.

A *source* serves threefold's logical tensors (Hugging Face names; a mixture of experts as the
fused ``mlp.experts.gate_up_proj`` (E, 2f, h) / ``down_proj`` (E, h, f) and router
``mlp.gate.weight``) and reads any box of one, ``logical[a0:b0, a1:b1, ...]``, through
safetensors' lazy slicing (``safe_open(...).get_slice(key)[...]``), never a whole file:
``DictSource`` (tensors in memory), ``HFSource`` (a Hugging Face folder, checked from its
headers alone), ``CheckpointSource`` (a threefold checkpoint, whose tensors lie in *pieces*:
flat element ranges of tensor-parallel slices). ``open_checkpoint`` / ``open_sharded``
verify and open a checkpoint (the latter collectively, for resuming); ``open_pretrained``
opens either kind of folder for ``checkpoint.init_from``.

Where: ``base`` (the interface, ``DictSource``, boxes and blocks), ``hf_source``,
``checkpoint_source``, ``pretrained`` (finding and opening pretrained weights),
``gpt_oss_files`` (GPT-OSS's expert layouts, as transformers saves them or in MXFP4, served
as the shared layout) and ``mxfp4`` (the format's dequantisation).

The folder also holds what writes and names those files: ``checkpoint`` (sharded, atomic,
checksummed checkpoints; ``checkpoint_async`` saves them in the background,
``checkpoint_verify`` checks them, ``resharding`` says where each piece sits), ``hf`` and
``hf_config`` (Hugging Face export and import; config.json through the families' specs),
``hub`` (hub ids into the local cache) and ``model_source`` (which model a run builds).

The bound: reading a box takes exactly the box's elements, each once, so ``bytes_read`` (bytes
of tensor data taken from files, in the files' dtype) grows by exactly ``box elements × stored
element size``, whichever pieces or files hold them. Memory: the result (the box, in the dtype
asked for) plus a temporary of at most ``2 × BLOCK_BYTES``. (safetensors slices its memory
map: a slice is a view, so a strided copy out of it touches only the box's pages.)
"""

from threefold.weights.base import DictSource, MissingTensor, WeightSource
from threefold.weights.checkpoint_source import CheckpointSource, open_checkpoint, open_sharded
from threefold.weights.hf_source import HFSource
from threefold.weights.pretrained import find_checkpoint, open_pretrained

__all__ = ["CheckpointSource", "DictSource", "HFSource", "MissingTensor", "WeightSource",
           "find_checkpoint", "open_checkpoint", "open_pretrained", "open_sharded"]
