"""init_extension: the dimensions beyond data parallelism: tensor parallelism fprep plans
(``PrepConfig.tp``, see ``tensor_parallel``), or a data-parallel mesh sliced from a larger one.

Then parameters may already be DTensors over the other dimensions, and sharded checkpoints must
keep those placements; the state records which dimensions are not fprep's.
"""

from __future__ import annotations

from fprep.state import ExtensionState, PrepState, need
from fprep.transitions._base import transition
from fprep.transitions.tensor_parallel import plan_tensor_parallel


@transition
def init_extension(state: PrepState) -> PrepState:
    pg = need(state.process_group, "init_process_group", "init_extension")
    ignored = need(state.ignored, "init_ignored", "init_extension")
    tp = plan_tensor_parallel(state, pg, ignored)
    if tp is not None:
        return state.replace(
            extension=ExtensionState(
                is_slice=True,
                root_shape=tp.mesh_shape,
                root_dim_names=tp.mesh_dim_names,
                other_dims=("tp",),
                tensor_parallel=tp,
            )
        )
    mesh = state.inputs.mesh
    if mesh is None or not mesh.is_slice:
        return state.replace(extension=ExtensionState(is_slice=False))
    root_names = mesh.root_dim_names or ()
    others = tuple(n for n in root_names if n not in pg.mesh_dim_names)
    return state.replace(
        extension=ExtensionState(
            is_slice=True,
            root_shape=mesh.root_shape,
            root_dim_names=mesh.root_dim_names,
            other_dims=others,
        )
    )
