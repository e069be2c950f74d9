"""The plugin contract of ipubuild: every hook a plugin may implement, documented where declared.

A plugin is a module with functions named like the hooks below, decorated with
``ipubuild.hookimpl``, and announced through the ``ipubuild`` entry-point group::

    [project.entry-points.ipubuild]
    rmsnorm = "ipubuild_rmsnorm.plugin"

ipubuild's own features (the ViT front end, the operators and their C kernels, the cast
policies, the graph passes, the search heuristics, the simulator device, the HTTP cache) are
plugins registered the same way. ``docs/reference.md`` describes every type named here.
A plugin's distribution name, version and code fingerprint enter the action keys of the phases
that call its hooks, so installing, upgrading or editing it re-runs exactly those phases.

Registration hooks (``ipubuild_operators`` and friends) take no arguments and must give the
same answer every time they are called (ipubuild may call them in several phases and
processes); every plugin's result is collected. A hook that raises, or returns something
malformed, or declares a name another plugin already declared, is reported as a one-line error
naming the plugin and the hook.
"""
import pluggy

hookspec = pluggy.HookspecMarker("ipubuild")


@hookspec
def ipubuild_operators():
    """Declare operators.

    Called when the operator registry is first built. Return a list of
    :class:`ipubuild.operators.Operator`: its ``name`` (unique across all plugins: a name
    registered twice is an error naming both plugins), ``infer`` (shape and dtype inference,
    raising ``ValueError`` with a message for bad inputs), ``reference`` (numpy evaluation in
    device precision), ``plans`` (the ways it splits over tiles), ``lower`` (the per-tile work of
    a plan: blocks read and written and the kernel vertex each tile runs) and ``kernels`` (the
    C sources with their variants and cycle estimators). Optionally: ``follows`` /
    ``follow_plans`` / ``follow`` (taking a producer's blocks, so an input needs no exchange),
    ``fuses_cast`` (writing FP8 directly, a cast folded into its kernel), ``macs`` (for the
    program-independent bound) and ``tolerance`` (how far the device's result may be from the
    reference's, for the per-operation comparison). All results are collected.
    """


@hookspec(firstresult=True)
def ipubuild_build_model(family: str, params: dict, seed: int, where: str):
    """Build the graph of a model family, or return None if ``family`` is not yours.

    Called by the ``lower_model`` phase with the target's ``[model]`` table (``params``, without
    ``family``), its ``seed`` and ``where`` (the target file, for error messages). Return a
    :class:`ipubuild.frontend.Model`: the float32 :class:`ipubuild.ir.Graph` before casts, its
    constants and its deterministic example inputs (each ``{value id: numpy array}``). Raise
    ``ipubuild.errors.UserError(where + ": model.<key>", ...)`` for a bad parameter. The first
    non-None result wins.
    """


@hookspec
def ipubuild_model_families():
    """Return the list of model family names this plugin builds.

    Required of every plugin that implements ``ipubuild_build_model``: a target whose
    ``model.family`` no plugin lists is rejected when it loads, with the known names.
    """


@hookspec
def ipubuild_cast_policies():
    """Declare FP8 cast policies.

    Return ``{name: callable}``; the callable ``policy(graph, constants, inputs, params)``
    inserts cast operations into the float32 graph in place and returns the
    :class:`ipubuild.ir.CastStoragePolicy` it chose. ``params`` is the target's ``[casts]``
    table. Called by the ``lower_model`` phase. All results are merged; a name declared twice
    is an error. Where casts go, their attributes and the reusable built-in placement
    (``ipubuild.builtin.casts.place_casts``): docs/reference.md, "Cast policies".
    """


@hookspec
def ipubuild_graph_passes():
    """Declare graph passes: named rewrites of a model's graph.

    Return a list of :class:`ipubuild.passes.GraphPass`: ``name`` (unique across all plugins),
    ``run(model, target)`` (rewrites the :class:`ipubuild.frontend.Model` in place), ``stage``
    (``"float"``: the float32 graph before the cast policy; ``"cast"``: after it), ``order``
    (within the stage, lower first) and ``default`` (True: every target runs it; False: only
    targets listing it in ``[model] passes``). Called by the ``lower_model`` phase, whose action
    key holds every implementer. All results are collected; a name declared twice is an error.
    """


@hookspec
def ipubuild_onnx_converters():
    """Declare ONNX converters: how the ``onnx`` model family imports an ONNX node type.

    Return ``{op_type: converter}`` (the default ONNX domain) or ``{(domain, op_type):
    converter}``. ``converter(ctx, node)`` is called for every node of that type, in the model's
    order, after constant folding; ``node`` (:class:`ipubuild.graph.onnx_import.Node`) has ``name``,
    ``op_type``, ``domain``, ``inputs``, ``outputs`` (tensor names), ``attrs`` (decoded: ints,
    floats, strings, lists, numpy arrays) and ``opset``. ``ctx``
    (:class:`ipubuild.graph.onnx_import.Converter`) gives ``ctx.value(name)`` (the ipubuild value id of
    an input tensor), ``ctx.constant(name)`` (a constant input as a numpy array, else None),
    ``ctx.shape(name)`` (its ONNX shape), ``ctx.add(type, inputs, **attrs)`` (append an ipubuild
    operation named after the node; returns its output's id) and ``ctx.add_constant(array,
    name)``. Return a list with the ipubuild value id of each node output (whose row-major data is
    that ONNX tensor). Raise ``ValueError`` with a message for a node you cannot convert (reported
    naming the node). Called by the ``lower_model`` phase, whose action key holds every
    implementer. All results are merged; an op type declared twice is an error naming both.
    """


@hookspec
def ipubuild_targets():
    """Ship build targets.

    Return a list of paths to target files (``<name>.toml``, checked like the tree's own
    ``targets/*.toml``). ``doit build:<name>`` finds them after the tree's own targets and
    builds them into the tree's ``artifacts/<name>/``; bare ``doit`` builds only the tree's own.
    A name the tree and a plugin (or two plugins) both give is an error naming both. Messages
    and action keys name a shipped file by its path inside its package
    (``ipubuild_rmsnorm/targets/vit_rms_small.toml``), so a build does not depend on where the
    plugin is installed. Called when a tree's tasks are derived. All results are collected.
    """


@hookspec
def ipubuild_search_heuristics():
    """Declare layout-search heuristics.

    Return a list of :class:`ipubuild.search.Heuristic`: each proposes layout changes
    (``propose(layout, context) -> list[Changes]``) to the incumbent in every local-search
    round of ``plan_package``, for every target. Proposals are screened, deduplicated and
    costed by ipubuild, so a heuristic may propose freely; it must be deterministic, and should
    propose only what concerns it (another target's search sees its proposals too). Its name
    (an identifier) names its proposals (``<name>#<index>``) and its counts in the round's log
    lines and the search state. All results are collected and run in name order; a name
    declared twice is an error.
    """


@hookspec
def ipubuild_device_backends():
    """Declare device backends.

    Return ``{name: factory}``; ``factory()`` gives an object with ``run(package: bytes,
    inputs: dict[str, numpy array], workdir: Path) -> ipubuild.device.DeviceRun``: ``package``
    is the ``.ipuexe`` file's bytes (not its path), ``inputs`` the graph inputs by value name,
    ``workdir`` a scratch folder removed afterwards. It returns the outputs by name, a profile
    (JSON-able; ipubuild reads ``ok`` — every vertex succeeded —, ``tiles``, ``samples`` and
    ``total_cycles``, and, if there, ``failures`` — up to 16 dicts, each with ``kind``
    ``"vertex"`` (``step``, ``name``, ``tile``, ``vertex``, ``kernel``, ``code``, ``reason``) or
    ``"exchange"`` (``step``, ``name``, ``reason``) — and ``failure_count``) and Chrome trace
    events. The backend should read the package with ``ipubuild.package.Package`` (its tile
    images' data segments are memoryviews of the package's bytes: ``bytes(view)`` for a copy to
    keep, pickle or join) and own its device with ``ipubuild.device.device_ownership``. The target's ``[target] device`` names the
    one used. Called by ``run_device``. All results are merged; a name declared twice is an error.

    A backend that can read back operations' outputs (for the per-operation comparison,
    ``[numerics] compare``) takes a keyword argument ``probes``: ``{step: [{"name", "dtype",
    "shape", "blocks": [[tile, address, r0, r1, c0, c1], ...]}]}`` — after the compute phase
    of ``step``, the value ``name`` (seen as a matrix of ``shape[:-1]`` product rows) has its
    block ``[r0:r1, c0:c1]`` stored row-major at ``address`` on ``tile`` — and returns the
    values read in ``DeviceRun.values`` by name. Without that argument, only graph outputs are
    compared.

    A backend class (the factory) may also define ``prepare()``, which readies what its runs
    need (the simulator compiles its C helpers): as a build starts running a target's phases,
    it calls ``factory().prepare()`` for the target's device on a background thread, so it
    may be called more than once and must be idempotent. Its errors are ignored (``run`` meets
    them); the layout search waits for it before it forks its workers, so it should be quick.
    """


@hookspec
def ipubuild_cache_backends():
    """Declare remote cache backends (the second cache tier, ``$IPUBUILD_REMOTE_CACHE``).

    Return ``{scheme: factory}``; ``factory(url)`` is called with the URL when a build starts
    (again in each forked worker process) and gives an object with:

    * ``get(kind, key) -> bytes | None`` — ``kind`` is ``"cas"`` (``key`` is the blob's sha256)
      or ``"ac"`` (``key`` is an action key, 64 hex characters); None when the entry does not exist;
    * ``put(kind, key, data: bytes) -> None`` — store (overwrite) the entry;
    * optionally ``close()`` — release connections.

    A malformed URL raises ``ipubuild.errors.UserError("IPUBUILD_REMOTE_CACHE", ...)`` from the
    factory. A failed request raises ``ipubuild.remote.RemoteError(message)`` — with
    ``unreachable=True`` when the remote cannot be reached in time, which stops ipubuild asking
    it for the rest of the build; the message names the request, never a credential. ipubuild
    verifies everything it gets, counts failures, warns once per build and goes on locally, so
    a backend need not retry. ``get`` and ``put`` are called from several threads at once (the
    build and the upload thread) and must be thread-safe; an object is used only in the process
    that made it. The built-in ``http``/``https`` backend is ``ipubuild.builtin.httpcache``.
    All results are merged; a scheme declared twice is an error.
    """
