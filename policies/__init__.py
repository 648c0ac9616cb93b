"""Pure policies of Decoupled DiLoCo: the math and the decisions, nothing else.

Among them: fragment planning (``fragments``), round closing with a minimum quorum and an adaptive
grace window (``quorum``), merge weights (``weighting``), merge rules such as radial-directional
averaging (``merge_rules``, run by ``merge``), the per-fragment Nesterov outer step
(``outer_optimizer``), how an island adopts a published fragment (``adoption``), staleness checks
(``staleness``), outer-gradient quantization and top-k (``compression``; the interface in
``compressor``) with error feedback (``error_feedback``) and H over the run (``sync_schedule``).
Every module is plain functions and small classes over tensors and numbers that take time and
measurements as arguments; nothing here imports Ray or reads the clock, and the only global state is the
registries: the plug-ins' (``plugin_registry``: merge rules and compressors by name, the built-ins registered at
import, a user's when islands/plugins.py loads it) and the fault kinds' (``fault_kinds``: declarations, filled as
its classes are defined), so the simulator and the unit tests use the same code as the cluster. Import what you
need from its module explicitly.
"""
