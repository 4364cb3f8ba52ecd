# SPDX-License-Identifier: Apache-2.0
"""--config-file: horovodrun's YAML layout (apply shows it), read into the same settings as the flags.

A value fills in its setting only when the command line left it out: flags override the file. params also takes
shmcomm's allreduce_algo, torus_grid and torus_small_bytes. Unknown sections and keys are errors, so that a typo
does not pass silently; values go through the flags' own checks.
"""
import argparse

from .flags import ENV_FLAGS, dest

_CONVERTERS = {dest(flag): convert for flag, convert, _, _, _ in ENV_FLAGS}


def _switch(value):
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _negated(value):
    return not _switch(value)


# section -> {key: (dest, converter or None for the flag's own)}
LAYOUT = {
    "params": {"fusion_threshold_mb": ("fusion_threshold_mb", None), "cycle_time_ms": ("cycle_time_ms", None),
               "cache_capacity": ("cache_capacity", None),
               "hierarchical_allreduce": ("hierarchical_allreduce", _switch),
               "hierarchical_allgather": ("hierarchical_allgather", _switch),
               "torus_allreduce": ("torus_allreduce", _switch), "allreduce_algo": ("allreduce_algo", None),
               "torus_grid": ("torus_grid", None), "torus_small_bytes": ("torus_small_bytes", None)},
    "autotune": {"enabled": ("autotune", _switch), "log_file": ("autotune_log_file", None),
                 "warmup_samples": ("autotune_warmup_samples", None),
                 "steps_per_sample": ("autotune_steps_per_sample", None),
                 "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", None),
                 "gaussian_process_noise": ("autotune_gaussian_process_noise", None)},
    "timeline": {"filename": ("timeline_filename", None), "mark_cycles": ("timeline_mark_cycles", _switch)},
    "stall_check": {"enabled": ("no_stall_check", _negated),
                    "warning_time_seconds": ("stall_check_warning_time_seconds", None),
                    "shutdown_time_seconds": ("stall_check_shutdown_time_seconds", None)},
    "library_options": {"mpi_threads_disable": ("mpi_threads_disable", _switch),
                        "num_nccl_streams": ("num_nccl_streams", None),
                        "ccl_bgt_affinity": ("thread_affinity", None), "thread_affinity": ("thread_affinity", None),
                        "gloo_timeout_seconds": ("gloo_timeout_seconds", None)},
    "logging": {"level": ("log_level", None), "with_timestamp": ("log_without_timestamp", _negated)},
}


def load(path):
    """The file's mapping; raises ValueError (unreadable, not YAML, not a mapping) with the reason."""
    try:
        import yaml
    except ImportError:
        raise ValueError("reading it needs PyYAML: pip install pyyaml") from None
    try:
        with open(path) as file:
            config = yaml.safe_load(file)
    except OSError as error:
        raise ValueError(f"cannot read it: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"not valid YAML: {error}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError("expected a mapping of sections (params, autotune, ...) at the top")
    return config


def apply(args, config):
    """Sets every setting the file gives and the command line left out (None); ValueError names the bad entry.
    The file's layout, horovodrun's:

        controller: gloo                 # or mpi (noted: shmcomm has one)
        params: {fusion_threshold_mb: 32, cycle_time_ms: 2, cache_capacity: 1024, hierarchical_allreduce: false,
                 hierarchical_allgather: false, torus_allreduce: false}
        autotune: {enabled: true, log_file: tune.csv, warmup_samples: 3, steps_per_sample: 10,
                   bayes_opt_max_samples: 20, gaussian_process_noise: 0.8}
        timeline: {filename: timeline.json, mark_cycles: true}
        stall_check: {enabled: true, warning_time_seconds: 60, shutdown_time_seconds: 0}
        library_options: {mpi_threads_disable: false, num_nccl_streams: 1, ccl_bgt_affinity: 0,
                          gloo_timeout_seconds: 30}
        logging: {level: warning, with_timestamp: false}
    """
    for section, values in config.items():
        if section == "controller":
            if str(values).lower() not in ("gloo", "mpi"):
                raise ValueError(f"controller: expected gloo or mpi, got {values!r}")
            if not (args.use_gloo or args.use_mpi):
                setattr(args, f"use_{str(values).lower()}", True)
            continue
        keys = LAYOUT.get(section)
        if keys is None:
            raise ValueError(f"unknown section {section!r}: expected controller, {', '.join(LAYOUT)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ValueError(f"{section}: expected a mapping of settings, got {values!r}")
        for key, value in values.items():
            if key not in keys:
                raise ValueError(f"{section}.{key}: unknown setting; {section} takes {', '.join(keys)}")
            name, convert = keys[key]
            if getattr(args, name) is not None:
                continue  # the command line said it
            try:
                setattr(args, name, (convert or _CONVERTERS[name])(value))
            except argparse.ArgumentTypeError as error:
                raise ValueError(f"{section}.{key}: {error}") from None
