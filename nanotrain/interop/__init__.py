"""Model weights in and out of nanotrain.

- `weights.py`: `nanotrain export` / `nanotrain import`, and the pretrained weights folders
  (`model_config.json` + `model.safetensors`) a `LanguageModelModule` starts from;
- `hf.py`: the key and config mapping to and from Hugging Face `transformers` checkpoints;
- `hf_io.py`: reading and writing those checkpoints (tensors, sharded safetensors, configs);
- `safetensors_writer.py`: safetensors files written one tensor at a time (bounded memory).
"""

from nanotrain.interop.safetensors_writer import save_file_streaming

__all__ = ["save_file_streaming"]
