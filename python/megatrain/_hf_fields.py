"""Which fields of ``transformers.TrainingArguments`` MegaTrain reads, which it may ignore, and which
it refuses unless they hold Hugging Face's default (docs/python.md, "transformers.TrainingArguments").

A field that changes what training computes and that MegaTrain does not implement is never ignored:
set to anything but its default, it is refused by name. Fields that only change where logs go,
hub uploads, data-loader workers or other mechanics with no MegaTrain counterpart are accepted
whatever they hold. A field in neither table (a newer transformers) is accepted when it is empty
or false and refused otherwise, so that nothing unknown silently changes meaning.
"""

from __future__ import annotations

from typing import Any, Dict, Set

# Fields with no effect on what MegaTrain computes: accepted with any value.
HARMLESS = {
    "overwrite_output_dir", "do_train", "do_eval", "do_predict", "logging_dir", "logging_strategy", "logging_first_step",
    "logging_nan_inf_filter", "save_safetensors", "save_on_each_node", "save_only_model", "report_to", "run_name",
    "disable_tqdm", "remove_unused_columns", "label_names", "dataloader_drop_last", "dataloader_num_workers",
    "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor", "push_to_hub",
    "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push", "hub_revision", "push_to_hub_model_id",
    "push_to_hub_organization", "push_to_hub_token", "local_rank", "ddp_backend", "ddp_timeout", "ddp_find_unused_parameters",
    "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "log_level", "log_level_replica", "log_on_each_node", "no_cuda", "use_cpu",
    "use_mps_device", "per_device_eval_batch_size", "per_gpu_train_batch_size", "per_gpu_eval_batch_size",
    "eval_accumulation_steps", "eval_delay", "prediction_loss_only", "include_inputs_for_metrics", "include_for_metrics",
    "include_num_input_tokens_seen", "include_tokens_per_second", "tf32", "gradient_checkpointing",
    "gradient_checkpointing_kwargs", "torch_compile", "torch_compile_backend", "torch_compile_mode", "skip_memory_metrics",
    "ray_scope", "debug", "jit_mode_eval", "use_ipex", "bf16_full_eval", "fp16_full_eval", "fp16_opt_level",
    "half_precision_backend", "fp16_backend", "mp_parameters", "full_determinism", "torchdynamo", "length_column_name",
    "resume_from_checkpoint", "restore_callback_states_from_checkpoint", "batch_eval_metrics", "eval_on_start",
    "eval_use_gather_object", "average_tokens_across_devices", "past_index", "greater_is_better", "metric_for_best_model",
    "dispatch_batches", "split_batches", "accelerator_config", "xpu_backend", "tpu_num_cores", "tpu_metrics_debug",
    "sharded_ddp", "fsdp_min_num_params", "fsdp_transformer_layer_cls_to_wrap", "fsdp_config", "optim_target_modules",
    "project", "trackio_space_id", "eval_do_concat_batches", "hub_revision", "liger_kernel_config", "use_legacy_prediction_loop", "save_total_limit_hub",
    "enable_jit_checkpoint", "parallelism_config", "logging_dir_suffix", "dataloader_in_order",
    # Read by TrainingArguments.from_hf into data_order (random: shuffled, sequential: sequential).
    "train_sampling_strategy",
}

# Fields that change training and that MegaTrain does not implement: accepted only at these values.
MUST_BE = {
    "fp16": {False},
    "optim": {"adamw_torch", "adamw_hf", "adamw_torch_fused", "adamw"},
    "lr_scheduler_kwargs": {None},
    "warmup_ratio": {0, 0.0, None},
    "label_smoothing_factor": {0, 0.0},
    "group_by_length": {False},
    "load_best_model_at_end": {False},
    "auto_find_batch_size": {False},
    "neftune_noise_alpha": {None},
    "deepspeed": {None},
    "fsdp": {None},
    "adafactor": {False},
    "use_liger_kernel": {False},
    "save_strategy": {"steps", "no"},
    "eval_strategy": {"no", "steps"},
    "evaluation_strategy": {"no", "steps", None},
    "ignore_data_skip": {False},
    "optim_args": {None},
    "torch_empty_cache_steps": {None},
    "sortish_sampler": {False},
    "predict_with_generate": {False},
    "data_seed": {None},
}


def _plain(v: Any) -> Any:
    # Enum values (IntervalStrategy.STEPS) compare by their .value; empty containers mean "not set".
    v = getattr(v, "value", v)
    if isinstance(v, (list, tuple, dict, str)) and len(v) == 0:
        return None
    return v


def check_hf_arguments(values: Dict[str, Any], ours: Set[str]) -> None:
    """Raises ValueError naming the first field MegaTrain cannot honour."""
    for name in sorted(values):
        if name in ours or name in HARMLESS:
            continue
        v = _plain(values[name])
        if name in MUST_BE:
            if v not in MUST_BE[name]:
                accepted = ", ".join(repr(a) for a in sorted(MUST_BE[name], key=repr))
                raise ValueError(f"TrainingArguments.{name}={values[name]!r} is not supported by MegaTrain; accepted: {accepted}")
            continue
        if v in (None, False, 0, 0.0):
            continue
        raise ValueError(f"TrainingArguments.{name}={values[name]!r}: MegaTrain does not know this field, so it cannot honour it; "
                         "accepted: leave it at its default (docs/python.md lists the fields read)")
