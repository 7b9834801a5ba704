"""A low-latency call's host path (issue 46, item 3): what the checks concluded for a signature, and what a pooled
allocation keeps (the handle, the front's export of it, the filled kernel arguments), come back call after call,
and every field a call sets is that call's own. No GPU needed: the torch front runs on CPU tensors, the Context's
device state is stand-in addresses, and no kernel is launched."""

import gc
import types

import numpy as np
import pytest

from cuep import _checks
from cuep.kernels.low_latency import CHOICE_SLOTS, COMBINE_ENTRY, DISPATCH_ENTRY, RECV_PHASE, SEND_PHASE
from cuep.modes import low_latency

torch = pytest.importorskip("torch")

MAX_TOKENS, HIDDEN, NUM_EXPERTS, NUM_RANKS = 8, 512, 8, 2


class FakeStream:
    ptr = 1

    def is_capturing(self) -> bool:
        return False


def _device_array(ptr: int):
    return types.SimpleNamespace(data=types.SimpleNamespace(ptr=ptr))


@pytest.fixture
def ctx(monkeypatch):
    """A Context over the torch front's own pool, on CPU tensors read as if they were on GPU 0."""
    from cuep.torch import front as torch_front
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)  # CPU-only torch
    monkeypatch.delenv("CUEP_REUSE_OUTPUTS", raising=False)
    monkeypatch.setattr(low_latency, "block_shared_bytes", lambda: 227 * 1024)
    allowed = []  # (library, entry, bytes) of each allow_shared_bytes
    monkeypatch.setattr(low_latency, "allow_shared_bytes", lambda library, entry, shared_bytes, static_bytes:
                        allowed.append((library, entry, shared_bytes)))
    front = torch_front.TorchFront(0)
    front.current_stream = FakeStream
    real_signature = front.signature
    # CPU tensors stand in for GPU 0's: the signature reads the device as 0, the checks read them as they are.
    front.signature = lambda value: (*real_signature(value)[:3], 0) if isinstance(value, torch.Tensor) \
        else real_signature(value)
    monkeypatch.setattr(_checks, "as_device_array", lambda call, name, value: _interop_view(value))

    def allocate(nbytes, dtype, regions, readable):
        storage = torch_front.Storage(torch.empty(nbytes // np.dtype(dtype).itemsize, dtype=front._dtypes[dtype][0]))
        return storage, (front.readable_views if readable else front.views)(storage, regions)

    front._pool._allocate = allocate
    library = types.SimpleNamespace(function=lambda entry: 0x5000 + len(entry))
    receive_library = types.SimpleNamespace(function=lambda entry: 0x6000 + len(entry))
    context = low_latency.Context(
        library=library, receive_library=receive_library, front=front, rank=1, num_ranks=NUM_RANKS,
        region_ptr=0x10_0000_0000,
        region_bytes=low_latency.size_hint(MAX_TOKENS, HIDDEN, NUM_RANKS, NUM_EXPERTS), num_sms=4, force_put=False,
        timeout_ns=10 ** 9, split_after_ns=20_000, hook_split_after_ns=5_000, seq_state=_device_array(0x2000),
        status=_device_array(0x3000), status_host_ptr=0x4000)
    context.allowed_shared_bytes = allowed  # read by the tests, not by the Context
    return context


def _interop_view(value):
    from cuep._interop import TensorView, _torch_to_numpy_dtypes
    return TensorView(value, _torch_to_numpy_dtypes()[value.dtype])


def inputs(num_tokens: int = 5, num_topk: int = 2):
    x = torch.zeros((num_tokens, HIDDEN), dtype=torch.bfloat16)
    topk_idx = torch.zeros((num_tokens, num_topk), dtype=torch.int64)
    return x, topk_idx


def dispatch(ctx, x, topk_idx, stats=None, wait_stats=None, max_tokens=MAX_TOKENS, num_experts=NUM_EXPERTS):
    shape, *addresses = low_latency.checked_dispatch("low_latency_dispatch()", ctx, x, topk_idx, max_tokens,
                                                     num_experts, stats, wait_stats, True, False, False)
    return low_latency.dispatch(ctx, shape, *addresses)


def test_a_dispatch_let_go_of_comes_back_with_its_handle_and_arguments_and_this_call_s_fields(ctx):
    x, topk_idx = inputs()
    recv_x, scales, count, handle, exported, run = dispatch(ctx, x, topk_idx)
    args = run.args
    first = (id(handle), id(exported), id(args), recv_x.data_ptr())
    assert exported.core is handle and exported[0] is handle.items[0] and exported[2:] == (MAX_TOKENS, HIDDEN,
                                                                                          NUM_EXPERTS)
    del recv_x, scales, count, handle, exported, run, args
    gc.collect()
    stats = torch.zeros(NUM_EXPERTS // NUM_RANKS, dtype=torch.int32)
    fewer, ids = inputs(num_tokens=3)
    recv_x, scales, count, handle, exported, run = dispatch(ctx, fewer, ids, stats)
    args = run.args
    assert (id(handle), id(exported), id(args), recv_x.data_ptr()) == first
    assert handle.num_tokens == 3 and args.num_tokens == 3
    assert (args.x, args.topk_idx, args.cumulative_stats, args.wait_stats) == (fewer.data_ptr(), ids.data_ptr(),
                                                                              stats.data_ptr(), None)  # NULL
    # Every other field is what a struct built whole for this allocation holds.
    plan = next(iter(ctx.plans.values()))
    whole = low_latency._attach_dispatch(ctx, plan, handle.storage, [recv_x, count, scales, *handle.items])[0][2]
    whole.x, whole.topk_idx, whole.num_tokens, whole.ids_are_int64 = fewer.data_ptr(), ids.data_ptr(), 3, 1
    whole.cumulative_stats = stats.data_ptr()
    assert bytes(args) == bytes(whole)
    assert args.call_record == handle.storage.ptr + handle.regions["call_record"].offset
    assert args.recv_x == recv_x.data_ptr() and args.recv_count == count.data_ptr()
    assert args.recv_scales == scales.data_ptr() and args.recv_src_info == handle.items[0].data_ptr()
    del recv_x, scales, count, handle, exported, run, args
    gc.collect()
    # A third call, without statistics but with wait statistics: nothing of the second's is left.
    waits = torch.zeros(NUM_RANKS, dtype=torch.int64)
    *_, handle, exported, run = dispatch(ctx, x, topk_idx, wait_stats=waits)
    assert id(run.args) == first[2] and run.args.cumulative_stats is None and run.args.wait_stats == waits.data_ptr()
    assert run.args.num_tokens == handle.num_tokens == 5 and run.args.x == x.data_ptr()


def test_both_launches_tell_the_kernels_that_every_peer_takes_direct_stores(ctx):
    """The kernels skip their per-peer lookups only where the Buffer found every peer mapped (all_direct; a
    Context made without it keeps the lookups)."""
    assert not ctx.all_direct
    ctx.all_direct = True
    x, topk_idx = inputs()
    *_, handle, exported, run = dispatch(ctx, x, topk_idx)
    assert run.args.all_direct == 1 and run.args.force_put == 0
    expert_x = torch.zeros((NUM_EXPERTS // NUM_RANKS, NUM_RANKS * MAX_TOKENS, HIDDEN), dtype=torch.bfloat16)
    weights = torch.zeros((5, 2), dtype=torch.float32)
    shape, *addresses = low_latency.checked_combine("low_latency_combine()", ctx, expert_x, topk_idx, weights,
                                                    handle, None, None)
    _, combine_run = low_latency.combine(ctx, shape, handle, *addresses)
    assert combine_run.args.all_direct == 1


def test_a_held_handle_keeps_its_allocation_from_the_next_dispatch(ctx):
    x, topk_idx = inputs()
    *_, exported, _ = dispatch(ctx, x, topk_idx)
    gc.collect()
    other = dispatch(ctx, x, topk_idx)
    assert other[4] is not exported and other[3].storage.ptr != exported.core.storage.ptr
    assert exported.core.num_tokens == 5  # the held handle is left as its call made it


def test_a_combine_sets_its_handle_s_addresses_and_its_choices_on_its_pooled_output(ctx):
    for num_topk in (2, CHOICE_SLOTS + 1, 2):
        x, topk_idx = inputs(num_topk=num_topk)
        *_, handle, exported, _ = dispatch(ctx, x, topk_idx)
        expert_x = torch.zeros((NUM_EXPERTS // NUM_RANKS, NUM_RANKS * MAX_TOKENS, HIDDEN), dtype=torch.bfloat16)
        weights = torch.zeros((5, num_topk), dtype=torch.float32)
        shape, *addresses = low_latency.checked_combine("low_latency_combine()", ctx, expert_x, topk_idx, weights,
                                                        handle, None, None)
        out, run = low_latency.combine(ctx, shape, handle, *addresses)
        args = run.args
        plan = ctx.plans[shape.plan_key]
        assert tuple(out.shape) == (5, HIDDEN) and args.combined_x == out.data.ptr
        assert (args.x, args.topk_idx, args.topk_weights) == (expert_x.data_ptr(), topk_idx.data_ptr(),
                                                              weights.data_ptr())
        assert (args.num_tokens, args.num_topk) == (5, num_topk)
        assert (args.combine_rows, args.source_tokens, args.call_record - 8) == (
            handle.address("combine_rows"), handle.address("source_tokens"), handle.address("call_record"))
        assert (args.choice_slots or 0) == (plan.choice_slots if num_topk <= CHOICE_SLOTS else 0) and plan.choice_slots
        del out, run, args, handle, exported
        gc.collect()


def test_a_hook_s_combine_send_looks_for_the_weights_as_long_as_a_whole_combine_when_captured(ctx, monkeypatch):
    """How long a combine's send looks for its sources' weights: a launch that also receives, split_after_ns
    (CUEP_COMBINE_SPLIT_US); a hook's send captured into a CUDA graph, the same; an eager one,
    hook_split_after_ns (CUEP_COMBINE_HOOK_SPLIT_US, 0 by default)."""
    from cuep import env
    from cuep.kernels import launcher
    launched = []
    monkeypatch.setattr(launcher.Launch, "__call__", lambda self, stream: launched.append(
        (self.args.phases, self.args.split_after_ns, self.args.hook_split_after_ns)))
    x, topk_idx = inputs()
    *_, handle, _, _ = dispatch(ctx, x, topk_idx)
    expert_x = torch.zeros((NUM_EXPERTS // NUM_RANKS, NUM_RANKS * MAX_TOKENS, HIDDEN), dtype=torch.bfloat16)
    shape, *addresses = low_latency.checked_combine("low_latency_combine()", ctx, expert_x, topk_idx,
                                                    torch.zeros((5, 2), dtype=torch.float32), handle, None, None)
    _, run = low_latency.combine(ctx, shape, handle, *addresses)
    capturing = types.SimpleNamespace(ptr=1, is_capturing=lambda: True)
    run(FakeStream(), SEND_PHASE)
    run(capturing, SEND_PHASE)
    run(FakeStream(), SEND_PHASE | RECV_PHASE)
    assert launched == [(SEND_PHASE, 20_000, 5_000), (SEND_PHASE, 20_000, 20_000),
                        (SEND_PHASE | RECV_PHASE, 20_000, 20_000)]  # the last reads split_after_ns only
    for name in ("CUEP_COMBINE_SPLIT_US", "CUEP_COMBINE_HOOK_SPLIT_US"):
        monkeypatch.delenv(name, raising=False)
    assert env.get("CUEP_COMBINE_SPLIT_US") == 20.0 and env.get("CUEP_COMBINE_HOOK_SPLIT_US") == 0.0
    monkeypatch.setenv("CUEP_COMBINE_HOOK_SPLIT_US", "20")
    assert env.get("CUEP_COMBINE_HOOK_SPLIT_US") == 20.0


def test_a_combine_refuses_a_handle_that_is_not_a_dispatch_s(ctx):
    x, topk_idx = inputs()
    with pytest.raises(TypeError, match="low_latency_combine\\(\\): handle must be"):
        low_latency.checked_combine("low_latency_combine()", ctx, x, topk_idx, topk_idx, ("not", "a handle"), None,
                                    None)


def test_a_combine_s_pooled_output_keeps_the_struct_of_its_own_plan(ctx):
    """Two plans whose outputs have one shape (the same tokens and hidden size, other experts and token
    capacity) do not share the pooled struct, which holds the plan's layout."""
    structs = []
    for max_tokens, num_experts in ((MAX_TOKENS, NUM_EXPERTS), (MAX_TOKENS // 2, NUM_EXPERTS // 2)):
        x, topk_idx = inputs(num_tokens=4)
        *_, handle, _, _ = dispatch(ctx, x, topk_idx, max_tokens=max_tokens, num_experts=num_experts)
        expert_x = torch.zeros((num_experts // NUM_RANKS, NUM_RANKS * max_tokens, HIDDEN), dtype=torch.bfloat16)
        weights = torch.zeros((4, 2), dtype=torch.float32)
        shape, *addresses = low_latency.checked_combine("low_latency_combine()", ctx, expert_x, topk_idx, weights,
                                                        handle, None, None)
        _, run = low_latency.combine(ctx, shape, handle, *addresses)
        assert (run.args.max_tokens, run.args.num_experts) == (max_tokens, num_experts)
        structs.append(id(run.args))
        del run, handle, _
        gc.collect()
    assert structs[0] != structs[1]


def test_a_hook_s_receive_launches_the_receive_only_build_and_every_other_launch_the_whole_one(ctx, monkeypatch):
    """A dispatch's and a combine's receive alone (a hook's) take the family's receive-only build (its kernels
    under the same names), sharing the call's argument struct; a send, or both phases, take the whole build."""
    from cuep.kernels import launcher
    launched = []
    monkeypatch.setattr(launcher.Launch, "__call__", lambda self, stream: launched.append(
        (self.entry, self.function, self.args.phases, id(self.args))))
    x, topk_idx = inputs()
    *_, handle, _, dispatch_run = dispatch(ctx, x, topk_idx)
    expert_x = torch.zeros((NUM_EXPERTS // NUM_RANKS, NUM_RANKS * MAX_TOKENS, HIDDEN), dtype=torch.bfloat16)
    shape, *addresses = low_latency.checked_combine("low_latency_combine()", ctx, expert_x, topk_idx,
                                                    torch.zeros((5, 2), dtype=torch.float32), handle, None, None)
    _, combine_run = low_latency.combine(ctx, shape, handle, *addresses)
    for run, entry in ((dispatch_run, DISPATCH_ENTRY), (combine_run, COMBINE_ENTRY)):
        launched.clear()
        for phases in (SEND_PHASE, RECV_PHASE, SEND_PHASE | RECV_PHASE, RECV_PHASE):
            run(FakeStream(), phases)
        whole, receive = ctx.library.function(entry), ctx.receive_library.function(entry)
        assert whole != receive
        assert launched == [(entry, whole, SEND_PHASE, id(run.args)), (entry, receive, RECV_PHASE, id(run.args)),
                            (entry, whole, SEND_PHASE | RECV_PHASE, id(run.args)),
                            (entry, receive, RECV_PHASE, id(run.args))]
    # Both builds' dispatch may take the call's dynamic shared memory (set once per kernel, before a launch).
    shared = {(id(library), entry) for library, entry, _ in ctx.allowed_shared_bytes}
    assert {(id(ctx.library), DISPATCH_ENTRY), (id(ctx.receive_library), DISPATCH_ENTRY)} <= shared
    assert len({size for _, entry, size in ctx.allowed_shared_bytes if entry == DISPATCH_ENTRY}) == 1


def test_the_empty_round_of_a_shrink_mode_clean_launches_a_dispatch_and_a_combine_of_no_tokens(ctx, monkeypatch):
    """``clean_low_latency_buffer`` in shrink mode runs a dispatch and a combine of no tokens, with no checks (its
    arrays are empty: no row is read): both launch with both phases, the combine on the dispatch's handle."""
    import cuep
    from cuep._interop import TensorView
    from cuep.kernels import launcher
    launched = []
    monkeypatch.setattr(launcher.Launch, "__call__", lambda self, stream: launched.append(
        (self.entry, self.args.phases, self.args.num_tokens, getattr(self.args, "call_record", None))))
    front = ctx.front
    front.empty = lambda shape, dtype: TensorView(torch.empty(shape, dtype=front._dtypes[dtype][0]),
                                                  front._dtypes[dtype][1])
    stream = types.SimpleNamespace(ptr=1, is_capturing=lambda: False, synchronize=lambda: None)
    front.current_stream = lambda: stream
    buffer = cuep.Buffer.__new__(cuep.Buffer)
    buffer._front, buffer._resources = front, types.SimpleNamespace(raise_if_failed=lambda: None)
    buffer._empty_low_latency_round(ctx, MAX_TOKENS, HIDDEN, NUM_EXPERTS)
    both = SEND_PHASE | RECV_PHASE
    (dispatch_entry, *dispatch_args), (combine_entry, *combine_args) = launched
    assert dispatch_entry.endswith("dispatch") and combine_entry.endswith("combine")
    assert dispatch_args[:2] == [both, 0] and combine_args[:2] == [both, 0]
    assert combine_args[2] == dispatch_args[2] + 8  # the combine's call record follows its dispatch's


def test_a_call_that_left_no_work_returns_deepep_s_event_overlap_of_no_event():
    from cuep.event import EventOverlap as CoreEventOverlap
    from cuep.torch.event import wrap
    assert wrap(CoreEventOverlap()).event is None
    assert not CoreEventOverlap().stands_for_work and CoreEventOverlap(event="recorded").stands_for_work
    assert wrap(CoreEventOverlap(event="recorded")).event.overlap.event == "recorded"


def test_a_routing_table_past_its_room_is_refused_naming_the_arguments(ctx, monkeypatch):
    # The region check passes (stand-in addresses); 1024 tokens of top-32 leave room for 512 local experts' counts.
    monkeypatch.setattr(low_latency, "check_fits", lambda call, ctx, max_tokens, hidden, num_experts:
                        low_latency.data_layout(max_tokens, hidden, ctx.num_ranks, num_experts))
    x, topk_idx = inputs(num_topk=32)
    with pytest.raises(ValueError, match=r"num_max_dispatch_tokens_per_rank=1024 tokens of top-32 to "
                                         r"num_experts=2050 need a routing table of 33798 words"):
        dispatch(ctx, x, topk_idx, max_tokens=1024, num_experts=2050)
    assert low_latency.routing_table_words(1024, 32, 1024, NUM_RANKS) <= low_latency.ROUTING_WORDS


def test_an_eager_combine_makes_the_general_path_s_output_struct_and_launch(ctx, monkeypatch):
    """A plain eager combine whose signature is known (``eager_combine``, the decode loop's call) takes the pooled
    output the general path (checked_combine, combine, both phases launched) would, fills the same struct and
    launches both phases on the given stream; before its signature and plan are known, and for a handle that is not
    a dispatch's, it does nothing and says so (None), for the general path to check and plan."""
    from cuep.kernels import launcher
    launched = []
    monkeypatch.setattr(launcher.Launch, "__call__", lambda self, stream: launched.append(
        (self.entry, self.function, stream, bytes(self.args))))
    x, topk_idx = inputs()
    *_, handle, _, _ = dispatch(ctx, x, topk_idx)
    expert_x = torch.zeros((NUM_EXPERTS // NUM_RANKS, NUM_RANKS * MAX_TOKENS, HIDDEN), dtype=torch.bfloat16)
    stream = FakeStream()
    for use_logfmt, waits in ((False, None), (True, torch.zeros(NUM_RANKS, dtype=torch.int64))):
        weights = torch.rand((5, 2), dtype=torch.float32)
        assert low_latency.eager_combine(ctx, stream, expert_x, topk_idx, weights, ("not", "a handle"), waits,
                                         use_logfmt) is None
        if waits is None:  # the first call: no signature checked, no plan made
            assert low_latency.eager_combine(ctx, stream, expert_x, topk_idx, weights, handle, waits,
                                             use_logfmt) is None
        shape, *addresses = low_latency.checked_combine("low_latency_combine()", ctx, expert_x, topk_idx, weights,
                                                        handle, None, waits)
        out, run = low_latency.combine(ctx, shape, handle, *addresses, use_logfmt=use_logfmt)
        run(stream, SEND_PHASE | RECV_PHASE)
        general, pointer = launched.pop(), out.data.ptr
        # The call's own fields scribbled over: the one-step path must set each of them again.
        for name in ("phases", "x", "topk_idx", "ids_are_int64", "topk_weights", "num_tokens", "num_topk",
                     "choice_slots", "combine_rows", "source_tokens", "call_record", "use_logfmt", "wait_stats"):
            setattr(run.args, name, 0x5A5A)
        del out, run
        gc.collect()
        other_weights = torch.rand((5, 2), dtype=torch.float32)  # a new array of the same signature
        eager = low_latency.eager_combine(ctx, stream, expert_x, topk_idx, other_weights, handle, waits, use_logfmt)
        assert eager is not None and eager.data.ptr == pointer  # the same pooled output, let go of
        assert_launched_as_the_general_path(ctx, stream, launched.pop(), general, low_latency.CombineArgs,
                                            "topk_weights", other_weights.data_ptr(), weights.data_ptr())
        del eager
        gc.collect()
    assert_a_forgotten_plan_is_declined(ctx, lambda: low_latency.eager_combine(ctx, stream, expert_x, topk_idx, weights,
                                                                              handle, None, False))
    assert not launched


def assert_launched_as_the_general_path(ctx, stream, launch, general, mirror, field, pointer, general_pointer):
    """The one step's ``launch`` (entry, function, stream, struct bytes) is the general path's (``general``): the
    same entry, function and stream, both phases, and every byte of the struct (a ``mirror``) but ``field``, which
    holds ``pointer`` where the general path's held ``general_pointer``."""
    entry, function, on, struct = launch
    assert (entry, function, on) == general[:3] == (mirror.entry, ctx.library.function(mirror.entry), stream)
    args = mirror.from_buffer_copy(struct)
    assert args.phases == SEND_PHASE | RECV_PHASE and getattr(args, field) == pointer
    setattr(args, field, general_pointer)
    assert bytes(args) == general[3]  # every other field as the general path set it


def assert_a_forgotten_plan_is_declined(ctx, one_step):
    """``one_step()`` (a call of a known signature) declines, doing nothing, once its plan was forgotten (past
    _MAX_PLANS): the general path plans it."""
    plans = dict(ctx.plans)
    ctx.plans.clear()
    assert one_step() is None
    ctx.plans.update(plans)


def core_buffer(ctx):
    """A ``cuep.Buffer`` over ``ctx`` alone: its low-latency calls run their host path, launches as the test sets."""
    import cuep
    from cuep._streams import CallStreams
    buffer = cuep.Buffer.__new__(cuep.Buffer)
    streams = CallStreams.__new__(CallStreams)
    streams.front = ctx.front
    buffer._resources = types.SimpleNamespace(low_latency_ready=lambda call, hand_over=True: ctx)
    buffer._front, buffer._streams, buffer._check_alive = ctx.front, streams, lambda call: None
    return buffer


def test_a_buffer_s_plain_combine_takes_one_step_once_known_and_every_other_the_general_path(ctx, monkeypatch):
    """cuep.Buffer.low_latency_combine: a plain call (no out, hook or async_finish, a bool use_logfmt) asks
    eager_combine first, on the current stream, and returns its exported output, an event of no work and no hook;
    the first call of a signature, and every call with out, a hook or another option, take the general path."""
    from cuep.kernels import launcher
    launched, asked = [], []
    monkeypatch.setattr(launcher.Launch, "__call__", lambda self, stream: launched.append(self.args.phases))
    eager = low_latency.eager_combine
    monkeypatch.setattr(low_latency, "eager_combine", lambda *args: asked.append(args[1]) or eager(*args))
    buffer = core_buffer(ctx)
    x, topk_idx = inputs()
    *_, handle, _, _ = dispatch(ctx, x, topk_idx)
    expert_x = torch.zeros((NUM_EXPERTS // NUM_RANKS, NUM_RANKS * MAX_TOKENS, HIDDEN), dtype=torch.bfloat16)
    weights = torch.zeros((5, 2), dtype=torch.float32)
    both = SEND_PHASE | RECV_PHASE
    first, event, hook = buffer.low_latency_combine(expert_x, topk_idx, weights, handle)  # learns the signature
    assert len(asked) == 1 and launched == [both] and hook is None and not event.stands_for_work
    pointer = first.data_ptr()
    del first
    gc.collect()
    combined, event, hook = buffer.low_latency_combine(expert_x, topk_idx, weights, handle)
    assert type(combined) is torch.Tensor and combined.data_ptr() == pointer  # the front's export, pooled
    assert len(asked) == 2 and type(asked[1]) is FakeStream and launched == [both, both]
    assert hook is None and not event.stands_for_work
    out = torch.zeros((5, HIDDEN), dtype=torch.bfloat16)
    assert buffer.low_latency_combine(expert_x, topk_idx, weights, handle, out=out)[0] is out
    _, _, hook = buffer.low_latency_combine(expert_x, topk_idx, weights, handle, return_recv_hook=True)
    assert callable(hook) and len(asked) == 2 and launched[2:] == [both, SEND_PHASE]


def test_an_eager_dispatch_makes_the_general_path_s_outputs_struct_and_launch(ctx, monkeypatch):
    """A plain eager dispatch whose signature is known (``eager_dispatch``) takes the pooled outputs and handle the
    general path (checked_dispatch, dispatch, both phases launched) would, sets the same fields and the handle's
    token count, and launches both phases on the given stream; unknown, or its plan forgotten, it does nothing."""
    from cuep.kernels import launcher
    launched = []
    monkeypatch.setattr(launcher.Launch, "__call__", lambda self, stream: launched.append(
        (self.entry, self.function, stream, bytes(self.args))))
    stream = FakeStream()
    for num_tokens, stats, waits in ((5, None, None), (3, torch.zeros(NUM_EXPERTS // NUM_RANKS, dtype=torch.int32),
                                                      torch.zeros(NUM_RANKS, dtype=torch.int64))):
        x, topk_idx = inputs(num_tokens=num_tokens)
        arguments = (x, topk_idx, MAX_TOKENS, NUM_EXPERTS, stats, waits, True, False, False)
        assert low_latency.eager_dispatch(ctx, stream, *arguments) is None  # the signature is new
        recv_x, scales, count, handle, exported, run = dispatch(ctx, x, topk_idx, stats, waits)
        run(stream, SEND_PHASE | RECV_PHASE)
        general, pointers = launched.pop(), (recv_x.data_ptr(), scales.data_ptr(), count.data_ptr())
        for name in ("phases", "x", "num_tokens", "topk_idx", "ids_are_int64", "cumulative_stats", "wait_stats"):
            setattr(run.args, name, 0x5A5A)  # scribbled over: the one-step path must set each again
        handle.num_tokens = -1
        del recv_x, scales, count, handle, exported, run
        gc.collect()
        other_x = torch.zeros_like(x)  # a new array of the same signature
        recv_x, scales, count, exported = low_latency.eager_dispatch(ctx, stream, other_x, *arguments[1:])
        assert (recv_x.data_ptr(), scales.data_ptr(), count.data_ptr()) == pointers and exported.core.num_tokens == \
            num_tokens
        assert_launched_as_the_general_path(ctx, stream, launched.pop(), general, low_latency.DispatchArgs, "x",
                                            other_x.data_ptr(), x.data_ptr())
        del recv_x, scales, count, exported
        gc.collect()
    assert_a_forgotten_plan_is_declined(ctx, lambda: low_latency.eager_dispatch(ctx, stream, *arguments))
    assert not launched


def test_a_buffer_s_plain_dispatch_takes_one_step_once_known_and_hooks_the_general_path(ctx, monkeypatch):
    """cuep.Buffer.low_latency_dispatch: a plain call asks eager_dispatch first, on the current stream, and returns
    its outputs and exported handle, an event of no work and no hook; its first call, and a hook's, take the general
    path."""
    from cuep.kernels import launcher
    launched, asked = [], []
    monkeypatch.setattr(launcher.Launch, "__call__", lambda self, stream: launched.append(self.args.phases))
    eager = low_latency.eager_dispatch
    monkeypatch.setattr(low_latency, "eager_dispatch", lambda *args: asked.append(args[1]) or eager(*args))
    buffer = core_buffer(ctx)
    x, topk_idx = inputs()
    both = SEND_PHASE | RECV_PHASE
    (recv_x, scales), count, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, NUM_EXPERTS)
    assert len(asked) == 1 and launched == [both] and hook is None and not event.stands_for_work
    first = (recv_x.data_ptr(), scales.data_ptr(), count.data_ptr(), id(handle))
    del recv_x, scales, count, handle
    gc.collect()
    (recv_x, scales), count, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, NUM_EXPERTS)
    assert (recv_x.data_ptr(), scales.data_ptr(), count.data_ptr(), id(handle)) == first
    assert type(handle).__name__ == "LowLatencyHandle" and handle.core.num_tokens == 5
    assert len(asked) == 2 and type(asked[1]) is FakeStream and launched == [both, both]
    assert hook is None and not event.stands_for_work
    *_, hook = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, NUM_EXPERTS, return_recv_hook=True)
    assert callable(hook) and len(asked) == 2 and launched[2:] == [SEND_PHASE]


def test_a_buffer_s_bf16_dispatch_returns_its_rows_alone_on_both_paths(ctx, monkeypatch):
    """Without FP8 a dispatch returns recv_x alone (no scales), from the general path and from the one step."""
    from cuep.kernels import launcher
    monkeypatch.setattr(launcher.Launch, "__call__", lambda self, stream: None)
    buffer = core_buffer(ctx)
    x, topk_idx = inputs()
    pointers = []
    for _ in range(2):  # the general path, then the one step
        recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, NUM_EXPERTS, use_fp8=False)
        assert type(recv_x) is torch.Tensor and recv_x.dtype == torch.bfloat16
        assert tuple(recv_x.shape) == (NUM_EXPERTS // NUM_RANKS, NUM_RANKS * MAX_TOKENS, HIDDEN)
        pointers.append(recv_x.data_ptr())
        del recv_x, count, handle
        gc.collect()
    assert pointers[0] == pointers[1]


def torch_buffer(ctx):
    """A ``cuep.torch.Buffer`` over :func:`core_buffer`."""
    import cuep.torch
    buffer = cuep.torch.Buffer.__new__(cuep.torch.Buffer)
    buffer._core, buffer._front = core_buffer(ctx), ctx.front
    return buffer


def test_the_torch_buffer_s_plain_calls_take_the_core_s_one_step_once_known(ctx, monkeypatch):
    """cuep.torch.Buffer's low_latency_dispatch and low_latency_combine: a plain call of a known signature goes
    straight to the core's one step (the core's full path not called) and returns DeepEP's types: the pooled torch
    outputs, a LowLatencyHandle, an EventOverlap of no event, no hook. The first call of a signature, a hook's, and a
    combine with ``out`` take the core's full path."""
    from cuep.kernels import launcher
    from cuep.torch import EventOverlap
    launched, full = [], []
    monkeypatch.setattr(launcher.Launch, "__call__", lambda self, stream: launched.append(self.args.phases))
    buffer = torch_buffer(ctx)
    for name in ("_full_low_latency_dispatch", "_full_low_latency_combine"):
        method = getattr(buffer._core, name)
        monkeypatch.setattr(buffer._core, name, lambda *args, _name=name, _method=method: full.append(_name)
                            or _method(*args))
    x, topk_idx = inputs()
    expert_x = torch.zeros((NUM_EXPERTS // NUM_RANKS, NUM_RANKS * MAX_TOKENS, HIDDEN), dtype=torch.bfloat16)
    weights = torch.zeros((5, 2), dtype=torch.float32)
    both = SEND_PHASE | RECV_PHASE
    seen = []
    for _ in range(2):  # the first calls learn the signatures, the second take the one step
        (recv_x, scales), count, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS,
                                                                                   NUM_EXPERTS)
        combined, combine_event, combine_hook = buffer.low_latency_combine(expert_x, topk_idx, weights, handle)
        assert type(handle).__name__ == "LowLatencyHandle" and handle.core.num_tokens == 5
        assert all(type(tensor) is torch.Tensor for tensor in (recv_x, scales, count, combined))
        assert recv_x.dtype == torch.float8_e4m3fn and combined.shape == (5, HIDDEN)
        for made in (event, combine_event):
            assert type(made) is EventOverlap and made.event is None
        assert hook is None and combine_hook is None
        seen.append((recv_x.data_ptr(), scales.data_ptr(), count.data_ptr(), id(handle), combined.data_ptr()))
        del recv_x, scales, count, handle, combined
        gc.collect()
    assert full == ["_full_low_latency_dispatch", "_full_low_latency_combine"] and launched == [both] * 4
    assert seen[0] == seen[1]  # the one step hands back the pooled outputs the full path made
    *_, handle, _, hook = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, NUM_EXPERTS, return_recv_hook=True)
    out = torch.zeros((5, HIDDEN), dtype=torch.bfloat16)
    assert buffer.low_latency_combine(expert_x, topk_idx, weights, handle, out=out)[0] is out
    assert full[2:] == ["_full_low_latency_dispatch", "_full_low_latency_combine"] and launched[4:] == [SEND_PHASE,
                                                                                                        both]
    with pytest.raises(TypeError, match="handle"):
        buffer.low_latency_combine(expert_x, topk_idx, weights, handle.core)  # not the torch handle
