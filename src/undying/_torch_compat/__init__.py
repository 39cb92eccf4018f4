"""The one place where undying touches torch's private APIs.

Imported by the worker runtime and the checkpoint code (worker; the checkpoint reader also in the
tools that read checkpoints). Everything else in undying uses torch's public API and the named
functions and constants here; a torch upgrade that moves an internal breaks one function here and one
named test in tests/unit/test_torch_compat.py, not a path somewhere in the runtime.

Known to work with: torch 2.13.0 (CPU wheel, gloo; what CI installs and runs these tests on), the
one version pyproject.toml declares; other versions are untested. The NCCL and CUDA-only entries
(``set_backend_timeout`` on NCCL options, ``pin_host_range``) are written for torch's CUDA build and
exercised by their tests only where that build is installed.

By concern (each function's docstring says what it needs and why the public API does not give it):

- ``dist``: a ProcessGroup around a backend built on undying's own store (``group_over_backend``),
  torch's process-group registry (``register_named_group``, ``default_group_names``), the
  DeviceMesh over undying's groups (``device_mesh_over_groups``), the ProcessGroup methods FSDP2
  and DTensor call (``FSDP_GROUP_METHODS``), DDP's bucket sizing (``bucket_assignment_by_size``),
  a backend's timeout option (``set_backend_timeout``).
- ``fsdp``: FSDP2's per-module parameter groups (``fsdp_meshes``, ``forget_unsharded_gradients``).
- ``training``: torch.compile's original module (``compiled_original``), autograd's end-of-backward
  callback (``queue_backward_callback``), the lazy ``torch._dynamo`` import (``import_dynamo``), an
  LR scheduler's children (``child_schedulers``), a GradScaler's per-step memory
  (``forget_grad_scaler_step``).
- ``tensors``: pytree mapping (``map_tensors``), the fused copy (``foreach_copy``), page-locking a
  mapping (``pin_host_range``), a state_dict's ``_metadata`` (``copy_state_dict_metadata``),
  torch.save's record checksums (``skip_record_crcs_when``).
- ``dcp``: torch.distributed.checkpoint internals (the empty-state-dict planner, the load without a
  process group, the fsspec reader and writer, a file view, tensor narrowing, ``set_element``);
  imported only where DCP is (it costs a worker over a second of import).
"""
