"""ckpt_ext in other libraries' training loops, one module per library, each imported on its own
(``import ckpt_ext`` imports none of them): ``ckpt_ext.integrations.transformers``."""
