"""RMSNorm in one launch, optionally with the residual add before it (vLLM's `rms_norm` / `fused_add_rms_norm`)."""
