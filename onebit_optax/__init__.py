"""onebit-optax: 1-bit Adam (Tang et al., 2021) and 0/1 Adam (Lu et al., 2023) as Optax transformations."""

from onebit_optax._accessors import moments
from onebit_optax._accumulate import accumulate_gradients
from onebit_optax._accumulate import clip_by_global_norm
from onebit_optax._checkpoint import abstract_state
from onebit_optax._checkpoint import restore_checkpoint
from onebit_optax._checkpoint import save_checkpoint
from onebit_optax._freeze import DefaultFreezeWarning
from onebit_optax._guards import LocalClippingWarning
from onebit_optax._freeze import FixedStepFreeze
from onebit_optax._freeze import fixed_step_freeze
from onebit_optax._freeze import VarianceRatioFreeze
from onebit_optax._freeze import variance_ratio_freeze
from onebit_optax._bounded import adam_update_bound
from onebit_optax._onebit_adam import onebit_adam
from onebit_optax._onebit_adam import scale_by_onebit_adam
from onebit_optax._onebit_adam import ScaleByOnebitAdamState
from onebit_optax._partition import mean_updates
from onebit_optax._partition import set_to_zero
from onebit_optax._sharding import init_sharded
from onebit_optax._sharding import local_params
from onebit_optax._sharding import model_replicated
from onebit_optax._sharding import state_partition_specs
from onebit_optax._status import assert_replicas_identical
from onebit_optax._status import replicas_identical
from onebit_optax._status import Status
from onebit_optax._status import status
from onebit_optax._zero_one_adam import scale_by_zero_one_adam
from onebit_optax._zero_one_adam import ScaleByZeroOneAdamState
from onebit_optax._zero_one_adam import zero_one_adam

__version__ = "0.1.0"

__all__ = (
    "abstract_state",
    "adam_update_bound",
    "assert_replicas_identical",
    "accumulate_gradients",
    "clip_by_global_norm",
    "DefaultFreezeWarning",
    "fixed_step_freeze",
    "FixedStepFreeze",
    "init_sharded",
    "LocalClippingWarning",
    "local_params",
    "mean_updates",
    "model_replicated",
    "moments",
    "onebit_adam",
    "replicas_identical",
    "restore_checkpoint",
    "save_checkpoint",
    "scale_by_onebit_adam",
    "set_to_zero",
    "ScaleByOnebitAdamState",
    "scale_by_zero_one_adam",
    "ScaleByZeroOneAdamState",
    "state_partition_specs",
    "Status",
    "status",
    "variance_ratio_freeze",
    "VarianceRatioFreeze",
    "zero_one_adam",
)
