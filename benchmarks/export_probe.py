"""jax.export of pallas_norm ops on the GPU: what JAX says, and what runs.

Usage (GPU machine): python benchmarks/export_probe.py
Prints, for a jitted RMSNorm forward and its gradient: the plain jax.export result (JAX
refuses custom calls without a compatibility guarantee), the export with that check
disabled for Pallas' Triton call target, a serialize/deserialize round trip and the
deserialized call's output against the jitted function's, and backend="xla"'s export.
"""
import sys
import jax
import jax.numpy as jnp
from jax import export
import pallas_norm

print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
x = jax.random.normal(jax.random.key(0), (256, 1024), jnp.bfloat16)
s = jnp.linspace(0.5, 1.5, 1024, dtype=jnp.float32)
fns = {
    "fwd": lambda x, s: pallas_norm.rms_norm(x, s),
    "grad": jax.grad(lambda x, s: pallas_norm.rms_norm(x, s).astype(jnp.float32).sum(),
                     argnums=(0, 1)),
    "fwd_xla": lambda x, s: pallas_norm.rms_norm(x, s, backend="xla"),
}
for name, fn in fns.items():
  f = jax.jit(fn)
  try:
    export.export(f)(x, s)
    print(name, "plain export: ok")
  except Exception as ex:  # noqa: BLE001 (report what JAX raises)
    print(name, "plain export:", type(ex).__name__, str(ex)[:400].replace("\n", " "))
  targets = set()
  text = f.lower(x, s).as_text()
  for line in text.splitlines():
    if "custom_call @" in line:
      targets.add(line.split("custom_call @", 1)[1].split("(", 1)[0])
  print(name, "custom_call targets:", sorted(targets))
  checks = [export.DisabledSafetyCheck.custom_call(t) for t in targets]
  try:
    e = export.export(f, disabled_checks=checks)(x, s)
    blob = e.serialize()
    e2 = export.deserialize(blob)
    got, want = e2.call(x, s), f(x, s)
    same = all(bool(jnp.array_equal(a, b)) for a, b in
               zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    print(name, f"export with checks disabled: ok, {len(blob)} bytes, round trip bitwise equal: {same}")
  except Exception as ex:  # noqa: BLE001
    print(name, "export with checks disabled:", type(ex).__name__, str(ex)[:400].replace("\n", " "))
sys.stdout.flush()
