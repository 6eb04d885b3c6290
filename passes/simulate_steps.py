"""One candidate of the budget search on arrays: Steps 2-5 of the step simulator.

passes.simulate's StepModel holds the joint graph as arrays (Step 1); a Candidate adds a
mirror plan's recomputation (Step 2, Chen et al. 2016, Alg. 2), partitions (Step 3),
rewrites in place (Step 4) and runs liveness (Step 5) on index lists, each step mirroring
the pass it names (see passes.simulate for the whole algorithm and its contract).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any


from memopt.allocator.lifetimes import Holds, StepShape, held_outside
from memopt.allocator.mirror import placement_order

from memopt.allocator.fusion import EXTERN, Fusion

from .fusion import graph_fusion
from .inplace import merge_storage
from .liveness import timeline_kind
from .meta import OpBytes, held_bytes, preset_workspace_bytes
from .shared_saves import saved_pairs
from .step_data import Proto, Simulated
from .workspace import Call, node_call, workspace_bytes_of

if TYPE_CHECKING:  # pragma: no cover
    from .simulate import StepModel

#: The levels of a node recomputed twice (Chen et al. 2016, Sec. 4.4), in their order.
LEVELS = ("A", "S", "B")


class Candidate:
    """One candidate's graphs as index lists over the model's nodes and its own mirror
    nodes (ids from len(model.protos) on)."""

    def __init__(self, model: StepModel, ops: Mapping[str, OpBytes] | None = None) -> None:
        self.m = model
        #: memopt's own ops' bytes as their configurations set them (None: read from the
        #: joint graph's node.meta, where the passes that configure them record them)
        self.ops = ops
        # per node id: its proto, its input nodes and its top-level arguments (the
        # model's nodes' first, a backward node's replaced where it reads mirror nodes)
        self.P: list[Proto] = list(model.protos)
        self.I: list[tuple[int, ...]] = list(model.inputs)
        self.A: list[tuple[Any, ...]] = list(model.args)
        self.order: list[int] = []                # every non-placeholder node, placed
        self.bw_outputs = list(model.bw_outputs)
        self.recomputed: set[int] = set()

    def proto(self, i: int) -> Proto:
        return self.P[i]

    def inputs_of(self, i: int) -> tuple[int, ...]:
        return self.I[i]

    def args_of(self, i: int) -> tuple[Any, ...]:
        return self.A[i]

    def _new(self, proto: Proto, inputs: tuple[int, ...], args: tuple[Any, ...]) -> int:
        self.P.append(proto)
        self.I.append(inputs)
        self.A.append(args)
        self.recomputed.add(len(self.P) - 1)
        return len(self.P) - 1

    # Step 2: passes.recompute.add_mirror_nodes and place_recomputation.
    def add_mirror_nodes(self, mirrored: frozenset[str], twice: frozenset[str]) -> None:
        m = self.m
        mirror = {i for i, n in m.mirrorable.items() if n.name in mirrored}
        doubled = {i for i in mirror if m.protos[i].name in twice}

        def level(reader: str, i: int) -> str:
            if i not in doubled:
                return "S"
            return "B" if reader in ("B", "bw") else "A"

        needed: set[tuple[int, str]] = set()
        stack = [(a, level("bw", a)) for _, a in m.read_by_backward if a in mirror]
        while stack:
            i, lvl = stack.pop()
            if (i, lvl) not in needed:
                needed.add((i, lvl))
                stack.extend((a, level(lvl, a)) for a in m.sources[i] if a in mirror)
        clones: dict[tuple[int, str], int] = {}
        ops: dict[str, dict[Any, int]] = {lvl: {} for lvl in LEVELS}
        for i, lvl in sorted(needed, key=lambda pair: (pair[0], LEVELS.index(pair[1]))):

            def env(a: int, lvl: str = lvl) -> int:
                return clones[(a, level(lvl, a))] if a in mirror else a

            how = m.made_by[i]
            if how == "twin":
                clones[(i, lvl)] = self._emit_twin(i, lvl, env, ops[lvl])
            elif how == "getitem":
                op = m.getitem_of[i]
                if op not in ops[lvl]:
                    ops[lvl][op] = self._copy(op, env)
                clones[(i, lvl)] = self._copy(i, lambda a, o=ops[lvl]: o.get(a, a))
            else:
                clones[(i, lvl)] = self._copy(i, env)
        for b in {b for b, a in m.read_by_backward if a in mirror}:
            self.I[b] = tuple(clones[(a, level("bw", a))] if a in mirror else a
                              for a in m.inputs[b])
            self.A[b] = tuple(clones[(a, level("bw", a))] if a in mirror else a
                              for a in m.args[b])
        # place_recomputation: each mirror node just before its first use
        inputs = self.I
        emitted = set(m.placeholders)
        # every joint node but the output (the last), mirror nodes where first read
        order = placement_order(range(len(m.protos) - 1), inputs.__getitem__, emitted)
        self.order = order
        self.recomputed &= emitted

    def _copy(self, i: int, env: Callable[[int], int]) -> int:
        return self._new(self.m.protos[i], tuple(env(a) for a in self.m.inputs[i]),
                         tuple(env(a) if a is not None else None for a in self.m.args[i]))

    def _emit_twin(self, item: int, lvl: str, env: Callable[[int], int],
                   shared: dict[tuple[int, int], int]) -> int:
        """passes.twins.emit_twin: the twin's nodes `item` needs, each made once per op
        and level (`shared`: (op, template position) -> mirror node)."""
        protos, position = self.m._twin(item, lvl)
        op = self.m.index[self.m._nodes[item].args[0]]

        def make(k: int) -> int:
            if (op, k) not in shared:
                proto, inputs = protos[k]
                mapped = tuple(make(a[1]) if a[0] == "t" else env(a[1]) for a in inputs)
                shared[(op, k)] = self._new(proto, mapped, mapped)
            return shared[(op, k)]

        return make(position)

    # Step 3: passes.partition.find_cut, passes.gradients, AOTAutograd's extraction.
    def partition(self) -> tuple["Graph", "Graph", list[int]]:
        m = self.m
        joint = len(m.protos)

        def in_region(i: int) -> bool:
            return i < joint and m.region[i]

        def find_cut() -> list[int]:
            read_outside = {a for i in self.order if not in_region(i) for a in self.I[i]}
            return [i for i in m.placeholders + self.order if in_region(i) and i in read_outside]

        def tensors(cut: list[int]) -> list[int]:
            return [i for i in cut if not self.P[i].symbolic and not self.P[i].tuple_valued]

        cut = find_cut()
        pairs = saved_pairs(tensors(cut), m.first_equal)  # passes.shared_saves
        if pairs:
            self._read_first_saved(pairs, in_region)
            cut = find_cut()
        saved = tensors(cut)
        symbols = [i for i in cut if self.P[i].symbolic]
        order = list(self.order)
        if m.existing_grads is not None:
            order, saved = self._accumulate(order, saved)
        graph = m.placeholders + order
        # the backward: saved values, symbols and tangents in, gradients out
        bw_in = symbols + saved + m.tangents
        bw_body = self._extract(graph, set(bw_in), self.bw_outputs, forward=False)
        used = {a for i in bw_body for a in self.I[i]} | \
            {i for i in self.bw_outputs if i is not None}
        saved = [i for i in saved if i in used]
        symbols = [i for i in symbols if i in used]
        bw = Graph(symbols + saved + m.tangents, bw_body, self.bw_outputs)
        fw_out = m.fw_outputs + saved + symbols
        fw = Graph(list(m.primals), self._extract(graph, set(m.primals), fw_out, forward=True),
                    fw_out)
        return fw, bw, saved

    def _read_first_saved(self, pairs: dict[int, int], in_region: Callable[[int], bool]
                          ) -> None:
        """passes.shared_saves.share_saved: backward readers of a saved duplicate read
        its chosen equal."""
        for i in self.order:
            if in_region(i) or not any(a in pairs for a in self.I[i]):
                continue
            self.I[i] = tuple(pairs.get(a, a) for a in self.I[i])
            self.A[i] = tuple(pairs.get(a, a) if a is not None else None for a in self.A[i])

    def _accumulate(self, order: list[int], saved: list[int]) -> tuple[list[int], list[int]]:
        """passes.gradients: save the parameters, and add each parameter's gradient into
        its `.grad` right after it is produced (after the inputs, for a tangent), or step
        the optimizer on it (`step_bytes`), also after the parameter's last reader."""
        m = self.m
        params = frozenset(m.existing_grads)
        names = {self.P[i].name for i in saved}
        saved = saved + sorted((m.by_name[p] for p in params - names),
                               key=lambda i: m.protos[i].name)
        if len(self.bw_outputs) != len(m.primals):
            return order, saved
        after: dict[int, list[int]] = {}
        steps = m.step_bytes
        position = {i: k for k, i in enumerate(order)}
        readers: dict[int, int] = {}  # storage -> its last reader (an optimizer step's)
        if steps is not None:
            for i in order:
                for a in self.I[i]:
                    for raw in self.P[a].raw:
                        readers[raw] = i
        for k, (primal, grad) in enumerate(zip(m.primals, self.bw_outputs)):
            name = m.protos[primal].name
            if name not in params or grad is None:
                continue
            where = -1 if self.P[grad].kind in ("primal", "tangent") else grad
            raw = self.P[primal].raw
            reader = readers.get(raw[0], -1) if raw and steps is not None else -1
            if reader >= 0 and position[reader] > position.get(where, -1):
                where = reader
            proto = m.accumulate_proto(None if steps is None else steps.get(name, 0))
            add = self._new(proto, (grad, primal), (grad, primal))
            self.recomputed.discard(add)
            after.setdefault(where, []).insert(0, add)
            self.bw_outputs[k] = add
        placed = after.get(-1, [])
        for i in order:
            placed.append(i)
            placed.extend(after.get(i, ()))
        return placed, saved

    def _extract(self, graph: list[int], inputs: set[int], outputs: list[int | None],
                 forward: bool) -> list[int]:
        """torch's _extract_graph_with_inputs_outputs: the nodes computable from
        `inputs` (and allowed in this graph), less those dead-code elimination removes;
        in `graph` order, inputs excluded."""
        valid: set[int] = set()
        for i in graph:
            if i in inputs:
                valid.add(i)
                continue
            p = self.P[i]
            if (p.in_backward if forward else p.in_forward) or p.kind in ("primal", "tangent"):
                continue
            if p.kind == "get_attr" or all(a in valid for a in self.I[i]):
                valid.add(i)
        live = {i for i in outputs if i is not None}
        live |= {i for i in valid if i not in inputs and self.P[i].impure}
        work = [i for i in live if i not in inputs]  # an input is a placeholder there
        while work:
            for a in self.I[work.pop()]:
                if a not in live and a in valid:
                    live.add(a)
                    if a not in inputs:
                        work.append(a)
        return [i for i in graph if i in live and i not in inputs and i in valid]

    # Step 4: passes.inplace.reinplace.
    def reinplace(self, graph: "Graph", enabled: bool) -> dict[int, tuple[int, Any]]:
        """{node: (the input it writes into, its variant)}: ("inplace",) or ("out", k)
        for the k-th top-level argument."""
        if not enabled:
            return {}
        nodes = graph.inputs + graph.body
        order = {i: k for k, i in enumerate(nodes)}
        end = len(nodes)  # the output node
        key_of = {i: self.P[i].single for i in nodes if self.P[i].single is not None}
        last_read: dict[Any, int] = {}
        pinned = {key_of[i] for i in graph.inputs if i in key_of}
        for k, i in enumerate(graph.body, start=len(graph.inputs)):  # in order: k grows
            for a in self.I[i]:
                if a in key_of:
                    last_read[key_of[a]] = k
            if self.P[i].opaque_output and i in key_of:
                pinned.add(key_of[i])
        for a in graph.outputs:
            if a is not None and a in key_of:
                last_read[key_of[a]] = end
                pinned.add(key_of[a])
        merged: dict[Any, Any] = {}

        def storage(i: int) -> Any:
            key = key_of.get(i)
            while key in merged:
                key = merged[key]
            return key

        def may_overwrite(i: int, src: int, position: int) -> bool:
            if src not in key_of or i not in key_of or not self.P[i].arg_ok[position]:
                return False
            key = storage(src)
            return not (key in pinned or last_read.get(key) != order[i]
                        or any(storage(a) == key for a in self.I[i] if a != src))

        rewrites: dict[int, tuple[int, Any]] = {}
        for i in graph.body:
            p = self.P[i]
            if p.kind != "call" or i not in key_of:
                continue
            args = self.A[i]
            found = None
            if p.inplace_target is not None and may_overwrite(i, args[0], 0):
                found = (args[0], ("inplace",))
            elif p.out_variant is not None:
                found = next(((a, ("out", k)) for k, a in enumerate(args)
                              if a is not None and may_overwrite(i, a, k)), None)
            if found is None:
                continue
            src, variant = found
            rewrites[i] = (src, variant)
            merge_storage(storage(i), storage(src), merged, last_read, pinned)
        return rewrites

    def _workspaces(self, nodes: list[int], rewrites: dict[int, tuple[int, Any]]
                    ) -> dict[int, int]:
        """passes.workspace: each node's workspace for the variant that runs."""
        found: dict[int, int] = {}
        todo: list[tuple[int, Proto, Any, Call]] = []
        for i in nodes:
            p = self.P[i]
            mine = self.ops.get(p.name) if self.ops is not None else None
            preset = mine.workspace if mine is not None else preset_workspace_bytes(p.node)
            if preset is not None:
                found[i] = preset
                continue
            if not self.m.measures:
                continue
            variant = rewrites[i][1] if i in rewrites else ("fn",)
            if p.workspace is None:
                p.workspace = {}
            if variant in p.workspace:
                found[i] = p.workspace[variant]
                continue
            call = _variant_call(p, variant)
            if call is None:
                p.workspace[variant] = 0
                continue
            todo.append((i, p, variant, call))
        if todo:
            for (i, p, variant, _), nbytes in zip(todo, workspace_bytes_of([t[3] for t in todo],
                                                                      self.m.workspaces)):
                p.workspace[variant] = nbytes
                found[i] = nbytes
        return {i: b for i, b in found.items() if b}

    def _flops(self, i: int) -> int:
        """passes.recompute.node_flops of node `i` as its inputs are in this candidate: a
        view of one of them costs nothing."""
        p = self.P[i]
        if p.single is None or any(self.P[a].single == p.single for a in self.I[i]):
            return 0
        return p.flops

    def _fusions(self, fw: "Graph", bw: "Graph") -> dict[bool, Fusion]:
        """passes.fusion's answer for the forward (False) and the backward (True): what
        inductor's fused kernels leave unallocated or write in place. A backward may
        reuse a saved value's buffer unless it is resident or an output to the caller."""
        m, P, I = self.m, self.P, self.I
        resident = {raw for i in m.primals for raw in P[i].raw}
        kept = resident | \
            {raw for i in fw.outputs[:m.num_fwd_outputs] if i is not None for raw in P[i].raw}
        answers = {}
        for backward, graph in ((False, fw), (True, bw)):
            def donated(i: int, backward: bool = backward) -> bool:
                p = P[i]
                return backward and p.kind != "tangent" and not p.symbolic \
                    and not kept.intersection(p.raw)

            answers[backward] = graph_fusion(
                graph.inputs, graph.body, graph.outputs, read=I.__getitem__,
                traits_of=lambda i: m.traits(P[i]), raw=lambda i: P[i].raw,
                donated=donated, cpu=m.cpu, arg=lambda i, k: self.A[i][k],
                freeable=lambda i, b=backward: b and not resident.intersection(P[i].raw))
        return answers

    # Step 5: passes.liveness.analyze_liveness, and the peak.
    def liveness(self, fw: "Graph", bw: "Graph", saved_values: list[int],
                 with_kinds: bool = False) -> Simulated:
        m = self.m
        parent: dict[int, int] = {}   # storages an in-place rewrite merged into another
        nbytes: dict[int, int] = {}
        fresh = itertools.count(-1, -1)  # backward allocations (raw storages are >= 0)

        def find(k: int) -> int:
            while k in parent:
                k = parent[k]
            return k

        P, I = self.P, self.I
        # passes.liveness Steps 1 and 2 in one walk: each value's storage (Step 1), then
        # its reads and its write (Step 2). Steps only grow, so a touch is the last so far;
        # an in-place rewrite merges two storages and their lifetimes.
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        resident: set[int] = set()
        resident_kind: dict[int, str] = {}  # passes.liveness's kind of each primal's storage
        recomputed_keys: set[int] = set()  # allocated by a mirror node (Step 2)
        chain_keys: set[int] = set()  # where memopt's opaque ops hold their states
        steps = num_forward = 0
        workspaces: list[tuple[int, int, bool]] = []  # (bytes, step, of an opaque op)
        keys_fw: dict[int, tuple[int, ...]] = {}
        keys_bw: dict[int, tuple[int, ...]] = {}
        fusions = self._fusions(fw, bw) if m.fused else {}
        for graph, keys, backward in ((fw, keys_fw, False), (bw, keys_bw, True)):
            start = steps if backward else -1
            fused = fusions.get(backward)
            for i in graph.inputs:
                p = P[i]
                keys[i] = own = p.raw
                for key, size in zip(own, p.nbytes):
                    if key not in nbytes:
                        nbytes[key] = size
                    k = find(key)
                    if not backward:
                        resident.add(k)
                        resident_kind.setdefault(k, m.primal_kinds.get(p.name, "input"))
                    if k not in first:
                        first[k] = start
                    last[k] = start
            rewrites = graph.rewrites
            if fused is None:
                spaces = self._workspaces(graph.body, rewrites)
                virtual, reads = frozenset(), {}
            else:  # inductor's kernels: its own have no workspace; in-place is theirs
                externs = [i for i in graph.body if m.traits(P[i]).kind == EXTERN]
                spaces = self._workspaces(externs, {
                    i: (None, ("relaid", m.traits(P[i]).relaid)) for i in externs
                    if m.traits(P[i]).relaid})
                for i, copied in fused.copies.items():  # arguments inductor lays out anew
                    spaces[i] = spaces.get(i, 0) + copied
                virtual, reads = fused.virtual, fused.reads
                rewrites = {i: (a, ("fused",)) for i, a in
                            (*fused.inplace.items(), *fused.reuse.items())}
            get = keys.get
            for i in graph.body:
                p = P[i]
                if i in virtual:  # computed inside the kernels that read it: no buffer
                    steps += 1
                    continue
                if backward:  # a backward op aliases an input only where its value is a view
                    alias: dict[int, int] = {}
                    for a in I[i]:
                        for raw, key in zip(P[a].raw, get(a, ())):
                            if raw not in alias:
                                alias[raw] = key
                    own = tuple(alias[raw] if raw in alias else next(fresh) for raw in p.raw)
                    if i in self.recomputed:
                        recomputed_keys.update(key for key in own if key < 0)
                else:
                    own = p.raw
                for key, size in zip(own, p.nbytes):
                    if key not in nbytes:
                        nbytes[key] = size
                if p.opaque:
                    mine = self.ops.get(p.name) if self.ops is not None else None
                    held_at = dict(mine.held) if mine is not None else held_bytes(p.node)
                    for index, held in held_at.items():
                        if index < len(own):
                            nbytes[find(own[index])] = held
                            chain_keys.add(find(own[index]))
                if i in rewrites and own and rewrites[i][0] in keys:
                    ra, rb = find(own[0]), find(keys[rewrites[i][0]][0])
                    if ra != rb:
                        parent[ra] = rb
                        nbytes[rb] = max(nbytes[ra], nbytes[rb])
                        if ra in first:
                            first[rb] = min(first[ra], first.get(rb, first[ra]))
                            last[rb] = max(last.pop(ra), last.get(rb, -1))
                            del first[ra]
                keys[i] = own
                step = steps
                steps += 1
                for a in reads.get(i, I[i]):
                    for key in get(a, ()):
                        k = find(key) if key in parent else key
                        if k not in first:
                            first[k] = step
                        last[k] = step
                if i in spaces:
                    workspaces.append((spaces[i], step, p.opaque))
                for key in own:
                    k = find(key) if key in parent else key
                    if k not in first:
                        first[k] = step
                    last[k] = step
            if not backward:
                num_forward = steps

        # Step 3: lifetimes the runtime imposes (allocator.lifetimes: liveness's too)
        shape = StepShape(num_forward=num_forward, num_steps=steps)
        kept = {find(k) for i in m.kept_outputs for k in keys_fw.get(i, ())}
        holds = Holds(
            resident=resident_kind, kept=kept,
            outputs={find(k) for i in fw.outputs[:m.num_fwd_outputs] if i is not None
                     for k in keys_fw.get(i, ())},
            gradients={find(k) for i in bw.outputs if i is not None
                       for k in keys_bw.get(i, ())},
            tangents={find(k) for i in m.tangents for k in keys_bw.get(i, ())},
            saved={find(k) for i in saved_values for k in keys_fw.get(i, ())})
        lifetimes = {key: (nbytes[key], s, holds.end(key, s, last[key], shape))
                     for key, s in first.items()}
        intervals = list(lifetimes.values())
        saved_bytes = sum(nbytes[key] for key, s in first.items()
                          if key in holds.saved and s < num_forward and not (
                              key in resident or key in holds.tangents
                              or key in holds.outputs))
        # (bytes, first, last, timeline kind) of what has no storage of its own
        extras = [(size, step, step, timeline_kind("activation", workspace=True, chain=opaque))
                  for size, step, opaque in workspaces]
        extras += [(h.nbytes, h.start, h.end, timeline_kind(h.kind)) for h in held_outside(
            shape, existing_grads=m.existing_grads if m.step_bytes is None else None,
            outside_bytes=m.outside,
            outside_grad_bytes=m.outside_grad_bytes, has_backward=True,
            saved_bytes=saved_bytes)]
        intervals += [extra[:3] for extra in extras]
        kinds: tuple[str, ...] = ()
        if with_kinds:  # passes.liveness Step 3's kinds, in that order
            kinds = tuple(timeline_kind(holds.kind_of(key, s, shape),
                                        recomputed=key in recomputed_keys,
                                        chain=key in chain_keys)
                          for key, s in first.items()) + tuple(extra[3] for extra in extras)
        flops = sum(self._flops(i) for i in bw.body if i in self.recomputed)
        # what memopt.oracle reads back: each storage's lifetime, each node's storages
        self.lifetimes, self.unkeyed = lifetimes, intervals[len(lifetimes):]
        self.keys = {**keys_fw, **keys_bw}
        self.find, self.num_forward = find, num_forward
        peak, runs = peak_and_runs(intervals, steps, m.granularity)
        at_peak = tuple(frozenset(m.mirrorable_of[k] for k, (_, s, e) in lifetimes.items()
                                  if s <= first_at and last_at <= e and k in m.mirrorable_of)
                        for first_at, last_at in runs)
        at = runs[0][0]
        peak_node = (fw.body + bw.body)[at] if 0 <= at < steps else None
        return Simulated(intervals=tuple(intervals), num_steps=steps, at_peak=at_peak,
                         peak_bytes=peak,
                         recompute_flops=flops, saved_bytes=saved_bytes, kinds=kinds,
                         peak_step="" if peak_node is None else
                         f"{'fw' if at < num_forward else 'bw'}.{P[peak_node].name}",
                         num_forward_steps=num_forward)


@dataclass
class Graph:
    """A forward or backward graph: its placeholders, its nodes in order, its outputs."""

    inputs: list[int]
    body: list[int]
    outputs: list[int | None]
    rewrites: dict[int, tuple[int, Any]] = field(default_factory=dict)  # Step 4


def _variant_call(p: Proto, variant: Any) -> Call | None:
    if variant[0] == "fn":
        return node_call(p.node)
    if variant[0] == "relaid":  # inductor's layout of the arguments (passes.fusion)
        return node_call(p.node, relaid=variant[1])
    if variant[0] == "inplace":
        return node_call(p.node, target=p.inplace_target)
    target, out_name = p.out_variant
    src = p.node.args[variant[1]]
    return node_call(p.node, target=target, kwargs={**p.node.kwargs, out_name: src})


#: How many runs of peak steps `Simulated.at_peak` tells apart.
PEAK_RUNS = 8


def peak_and_runs(intervals: list[tuple[int, int, int]], num_steps: int, granularity: int
          ) -> tuple[int, list[tuple[int, int]]]:
    """allocator.peak_live_bytes of the intervals, each rounded up to `granularity`, and
    the runs of consecutive steps where it is reached, as (first, last) (at most
    PEAK_RUNS: the last run reaches to the last peak step)."""
    if num_steps <= 0:
        return 0, [(-1, -1)]
    diff = [0] * (num_steps + 1)
    g = granularity
    for size, start, end in intervals:
        s, e = max(start, 0), min(end, num_steps - 1)
        if s <= e:
            size = -(-size // g) * g
            diff[s] += size
            diff[e + 1] -= size
    peak = live = 0
    runs: list[tuple[int, int]] = [(0, 0)]
    for step, d in enumerate(diff[:num_steps]):
        live += d
        if live > peak:
            peak, runs = live, [(step, step)]
        elif live == peak:
            if runs[-1][1] == step - 1 or len(runs) == PEAK_RUNS:
                runs[-1] = (runs[-1][0], step)
            else:
                runs.append((step, step))
    return peak, runs
