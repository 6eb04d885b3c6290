# Run from the repository root:
#   python benchmarks/fuzz_inductor_slice.py [inductor] [aten] [--models N]
"""Draw the slice strategy's 6 models (or N); run check_model under inductor (and aten
for comparison) on each, without stopping or shrinking; print per model."""
import sys, time
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
import torch
from hypothesis import given, settings, Phase, HealthCheck
from fuzz_models import model_specs
import test_fuzz as tf

args = sys.argv[1:]
count = 6
if "--models" in args:
    at = args.index("--models")
    count = int(args[at + 1])
    del args[at:at + 2]
specs = []
@settings(max_examples=count, derandomize=True, database=None, deadline=None,
          phases=[Phase.generate], suppress_health_check=list(HealthCheck))
@given(spec=model_specs(max_layers=6))
def collect(spec):
    specs.append(spec)
collect()
torch.set_num_threads(1)
kinds = args or ["inductor"]
for kernels in kinds:
    total = tf.Tally()
    for i, spec in enumerate(specs):
        tally = tf.Tally()
        t0 = time.perf_counter()
        status = "ok"
        try:
            out = tf.check_model(spec, tally, kernels)
        except BaseException as e:
            status = f"FAIL {type(e).__name__}: {str(e)[:1500]}"
            out = None
        dt = time.perf_counter() - t0
        print(f"=== [{kernels}] model {i}: {dt:.0f} s: {status}")
        print(f"    spec: {spec!r}")
        print(f"    {tally.line()}")
        if out is not None:
            for a in out.accepted:
                print(f"    accepted {a.budget!r}: budget {a.budget_bytes}, predicted {a.predicted}, measured {a.measured}")
            for b, n in out.refused:
                print(f"    refused {b!r} ({n} B)")
        for f in ("models","plans","refused","overshoots","mismatches","rounding","torch_differs","errors","non_monotonic"):
            setattr(total, f, getattr(total, f) + getattr(tally, f))
        total.worst_measured_over_budget = max(total.worst_measured_over_budget, tally.worst_measured_over_budget)
        total.worst_measured_over_predicted = max(total.worst_measured_over_predicted, tally.worst_measured_over_predicted)
        sys.stdout.flush()
    print(f"TOTAL [{kernels}]: {total.line()}")
