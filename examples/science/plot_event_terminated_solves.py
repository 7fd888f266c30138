"""
Event-terminated ODE solves under vmap: each sample stops at its own event
==========================================================================

An event-terminated solve integrates until a quantity crosses zero, a ball until it lands. Each
sample meets its event at its own time, and a solver that loops until the event cannot run under
``vmap``. Here the solve for one sample is written so that ``vmap`` can batch it: fixed Runge-Kutta
steps, each sample frozen with ``torch.where`` once its event has passed, and the crossing found
inside that step. ``vmap(grad(...))`` then gives each sample's derivative of where it lands,
checked against a closed form and SciPy's ``solve_ivp`` with events. Then what the freeze is for,
``backward()`` into a layer that makes the angles, the launch angle of longest range, why the loop
fails (asserted), and what the batch costs.
"""

import math

import matplotlib.pyplot as plt
import numpy as np
import torch
from scipy.integrate import solve_ivp
from scipy.optimize import minimize_scalar
from torch.func import grad, vmap
from torch.utils import benchmark

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")
F64 = {"dtype": torch.float64, "device": device}
GRAVITY, SPEED, HEIGHT, DRAG = 9.81, 20.0, 1.0, 0.05  # m/s², m/s, m, 1/m
DT, STEPS = 0.01, 420  # 4.2 s: longer than any flight below


# %%
# The recipe: fixed steps, each sample frozen at its event
# --------------------------------------------------------
# A ball launched at ``angle`` from 1 m up, with air drag ``-k |v| v``; the event: its height
# crossing zero. ``landing`` takes ``STEPS`` Runge-Kutta steps whatever happens, keeps the step in
# which the height first turns negative (its start, end and time), and after it holds the state
# still with ``torch.where`` (past the event a state may leave its field's domain). Inside that
# step the height is a cubic in time through both ends with their slopes (Hermite); five Newton
# steps from the straight-line guess find its root, and the same cubic for ``x`` gives the range.
# No Python ``if`` or ``while`` reads a tensor.
def field(state, drag):  # drag: a number, or a function of the height
    x, y, vx, vy = state
    k, speed = drag(y) if callable(drag) else drag, torch.sqrt(vx * vx + vy * vy)
    return torch.stack([vx, vy, -k * speed * vx, -GRAVITY - k * speed * vy])


def runge_kutta_step(state, drag):
    k1 = field(state, drag)
    k2 = field(state + DT / 2 * k1, drag)
    k3 = field(state + DT / 2 * k2, drag)
    return state + DT / 6 * (k1 + 2 * k2 + 2 * k3 + field(state + DT * k3, drag))


def cubic(start, end, slope_start, slope_end, s):  # Hermite; s from 0 to 1 over a step
    ends = (2 * s**3 - 3 * s**2 + 1) * start + (-2 * s**3 + 3 * s**2) * end
    return ends + DT * ((s**3 - 2 * s**2 + s) * slope_start + (s**3 - s**2) * slope_end)


def landing(angle, drag=DRAG, freeze=True):
    """Range and time of flight of one ball; also whether it landed within STEPS steps."""
    state = launch(angle)
    landed, time = torch.zeros_like(angle, dtype=torch.bool), torch.zeros_like(angle)
    start, end, start_time = state, state, time
    for _ in range(STEPS):
        new = runge_kutta_step(state, drag)
        crossing = ~landed & (new[1] <= 0)  # in this step, and not before
        start = torch.where(crossing, state, start)
        end = torch.where(crossing, new, end)
        start_time = torch.where(crossing, time, start_time)
        landed = landed | crossing
        state, time = torch.where(landed & freeze, state, new), time + DT
    height = lambda s: cubic(start[1], end[1], start[3], end[3], s)  # noqa: E731
    s = start[1] / (start[1] - end[1])  # where the straight line crosses
    for _ in range(5):
        s = s - height(s) / grad(height)(s)
    where = cubic(start[0], end[0], start[2], end[2], s)
    return (where, start_time + s * DT), landed


def launch(angle):  # x, y, vx, vy at t = 0
    zero = 0 * angle
    return torch.stack([zero, HEIGHT + zero, SPEED * angle.cos(), SPEED * angle.sin()])


def close_to(label, got, want, bound):  # gap over the largest reference entry
    gap = ((got - want).abs().max() / want.abs().max()).item()
    print(f"  {label}: {gap:.1e} of the largest entry (bound {bound:.0e})")
    assert gap <= bound, f"{label}: {gap:.1e} above {bound:.0e}"


angles = torch.linspace(0.15, 1.35, 64, **F64)  # radians, about 9° to 77°
(ranges, flight_times), landed = vmap(landing, in_dims=(0, None))(angles, 0.0)
assert landed.all(), "a ball still in the air after STEPS steps"

# %%
# Without drag the flight has a closed form: the time ``T`` solves ``h + v sinθ T − g T²/2 = 0``
# and the range is ``v cosθ T``. The steps above are exact for such a flight (its height is a
# polynomial of degree 2 in time, within both the Runge-Kutta step and the cubic), so only
# rounding separates them.
vertical = SPEED * angles.sin()
closed_times = (vertical + torch.sqrt(vertical**2 + 2 * GRAVITY * HEIGHT)) / GRAVITY
close_to("no drag, time of flight", flight_times, closed_times, 5e-14)
close_to("no drag, range", ranges, SPEED * angles.cos() * closed_times, 5e-14)


# %%
# Each sample's derivative: ``vmap(grad(...))``
# ---------------------------------------------
# How the range changes with the launch angle, per sample: ``grad`` differentiates one solve,
# through the frozen steps (``torch.where`` passes the gradient of the branch it took) and the
# Newton steps; ``vmap`` maps it over the angles. Reference without drag: the closed form's
# derivative, by float64 autograd.
def range_of(angle, drag=DRAG, freeze=True):
    return landing(angle, drag, freeze)[0][0]


slopes = vmap(grad(range_of), in_dims=(0, None))(angles, 0.0)
leaf = angles.clone().requires_grad_()
up = SPEED * leaf.sin()
closed_time = (up + torch.sqrt(up**2 + 2 * GRAVITY * HEIGHT)) / GRAVITY
closed_range = SPEED * leaf.cos() * closed_time
(closed_slopes,) = torch.autograd.grad(closed_range.sum(), leaf)
close_to("no drag, d range / d angle", slopes, closed_slopes, 1e-12)


# %%
# With drag: against SciPy's ``solve_ivp`` with an event
# ------------------------------------------------------
# With drag there is no closed form. SciPy's adaptive solver (DOP853, tolerances 1e-12) stops
# at the event itself (``terminal=True``, crossing downwards), one angle at a time, in a Python
# loop: an independent reference. Its derivative by central differences (a step of 1e-6 rad).
def scipy_landing(angle):
    def right_side(t, s):
        speed = math.hypot(s[2], s[3])
        return [s[2], s[3], -DRAG * speed * s[2], -GRAVITY - DRAG * speed * s[3]]

    def ground(t, s):
        return s[1]

    ground.terminal, ground.direction = True, -1
    start = [0.0, HEIGHT, SPEED * math.cos(angle), SPEED * math.sin(angle)]
    solved = solve_ivp(right_side, (0, 10), start, method="DOP853", rtol=1e-12, atol=1e-12,
                       events=ground)  # fmt: skip
    return solved.y_events[0][0][0], solved.t_events[0][0]


reference = torch.tensor([scipy_landing(a) for a in angles.tolist()], **F64)
(ranges, flight_times), landed = vmap(landing)(angles)
assert landed.all()
close_to("drag, range against SciPy", ranges, reference[:, 0], 2e-9)
close_to("drag, time of flight against SciPy", flight_times, reference[:, 1], 1e-9)
slopes = vmap(grad(range_of))(angles)
differences = [(scipy_landing(a + 1e-6)[0] - scipy_landing(a - 1e-6)[0]) / 2e-6
               for a in angles.tolist()]  # fmt: skip
close_to("drag, d range / d angle", slopes, torch.tensor(differences, **F64), 5e-8)


# %%
# Why freeze: a field not defined past the event
# ----------------------------------------------
# Past its event a sample may leave the region where its field is defined. A made-up drag that
# grows as ``√(1 + y / 1 m)``, not defined below ``y = −1 m``, with the freeze on and off: the
# landing points agree (the crossing step is kept either way), but without the freeze the later
# steps compute NaN. ``torch.where`` sends those steps a zero gradient, and the backward of each
# operation that computed a NaN turns that zero into NaN (0 × NaN): every slope comes out NaN. The
# freeze covers the steps after the crossing; the crossing step itself evaluates the field a little
# past the event (its Runge-Kutta stages), so a field defined only down to the event needs its
# input kept inside too: a drag ``√(y / 1 m)``, with and without ``torch.where`` on the height.
thin_air = lambda y: DRAG * torch.sqrt(1 + y)  # noqa: E731
frozen, loose = (vmap(landing, in_dims=(0, None, None))(angles, thin_air, f)[0][0]
                 for f in (True, False))  # fmt: skip
close_to("domain-limited drag, freeze on and off: range", loose, frozen, 1e-15)
slopes_for = {f: vmap(grad(range_of), in_dims=(0, None, None))(angles, thin_air, f)
              for f in (True, False)}  # fmt: skip
print(f"  slopes finite with the freeze: {bool(slopes_for[True].isfinite().all())}, "
      f"without: {bool(slopes_for[False].isfinite().all())}")  # fmt: skip
assert slopes_for[True].isfinite().all() and slopes_for[False].isnan().all()
to_ground = {"unguarded": lambda y: DRAG * torch.sqrt(y),
             "guarded": lambda y: DRAG * torch.sqrt(torch.where(y > 0, y, 0.0))}  # fmt: skip
lands = {k: vmap(landing, (0, None))(angles, drag)[1] for k, drag in to_ground.items()}
print("  drag defined down to the ground; balls that land:",
      {k: f"{int(v.sum())} of {len(v)}" for k, v in lands.items()})  # fmt: skip
assert lands["guarded"].all() and not lands["unguarded"].all(), lands

# %%
# Inside a model: ``backward()`` reaches what made the angles
# -----------------------------------------------------------
# The solve is ordinary torch code, so a loss on the landing points trains whatever produced
# the angles. Here a linear layer turns target distances into launch angles (through a
# sigmoid, kept between 0.15 and 1.35 rad); ``backward()`` through ``vmap(landing)`` fills its
# ``.grad``. Reference: central differences of the same loss in each of its two parameters.
torch.manual_seed(0)  # the layer's first weights
aim = torch.nn.Linear(1, 1).to(**F64)
targets = torch.linspace(20.0, 30.0, 8, **F64)


def miss(layer):  # mean squared distance between where each ball lands and its target
    angle = 0.15 + 1.2 * torch.sigmoid(layer(targets[:, None] / 30).squeeze(-1))
    return (vmap(landing)(angle)[0][0] - targets).square().mean()


miss(aim).backward()
w, b = aim.weight.item(), aim.bias.item()
at = lambda w, b: miss(lambda t: t * w + b).item()  # noqa: E731  (the layer, by hand)
differences = [(at(w + 1e-6, b) - at(w - 1e-6, b)) / 2e-6,
               (at(w, b + 1e-6) - at(w, b - 1e-6)) / 2e-6]  # fmt: skip
by_backward = torch.cat([aim.weight.grad.flatten(), aim.bias.grad])
by_differences = torch.tensor(differences, **F64)
close_to("backward() into the layer", by_backward, by_differences, 5e-9)


# %%
# The launch angle of longest range
# ---------------------------------
# Where the derivative crosses zero: between the two neighbouring angles whose slopes change
# sign, by a straight line. Without drag the answer is known in closed form
# (``sin θ = v / √(2 (v² + g h))``, just under 45° from a height); with drag, SciPy's bounded
# scalar minimiser on its own solves is the reference.
def best_angle(slopes):
    i = int((slopes[:-1] > 0).logical_and(slopes[1:] <= 0).nonzero()[0])
    a, b, fa, fb = angles[i], angles[i + 1], slopes[i], slopes[i + 1]
    return (a - fa * (b - a) / (fb - fa)).item()


no_drag_slopes = vmap(grad(range_of), in_dims=(0, None))(angles, 0.0)
known = math.asin(SPEED / math.sqrt(2 * (SPEED**2 + GRAVITY * HEIGHT)))
searched = minimize_scalar(lambda a: -scipy_landing(a)[0], bounds=(0.3, 1.2),
                           method="bounded", options={"xatol": 1e-10}).x  # fmt: skip
for label, found, want in [("no drag", best_angle(no_drag_slopes), known),
                           ("drag", best_angle(slopes), searched)]:  # fmt: skip
    print(f"  {label}: best angle {math.degrees(found):.3f}° (reference "
          f"{math.degrees(want):.3f}°, off by {abs(found - want):.1e} rad)")  # fmt: skip
    assert abs(found - want) < 5e-5, (label, found, want)

fig, (top, bottom) = plt.subplots(2, sharex=True, figsize=(7, 6), layout="constrained")
degrees = np.degrees(angles.cpu().numpy())
top.plot(degrees, vmap(range_of, in_dims=(0, None))(angles, 0.0).cpu(), color="0.6",
         label="no drag")  # fmt: skip
top.plot(degrees, ranges.cpu(), color="black", label=f"drag k = {DRAG} / m")
bottom.plot(degrees, no_drag_slopes.cpu(), color="0.6")
bottom.plot(degrees, slopes.cpu(), color="black")
bottom.axhline(0, color="0.8", linewidth=1)
for panel in (top, bottom):
    panel.axvline(math.degrees(searched), color="black", linestyle=":", linewidth=1)
top.set(ylabel="range (m)", title=f"Where {len(angles)} balls land, one vmap")
bottom.set(xlabel="launch angle (degrees)", ylabel="d range / d angle (m/rad)")
top.legend()
plt.show()


# %%
# Why a loop until the event fails under ``vmap``
# -----------------------------------------------
# The usual solve steps *while* the ball is in the air. Under ``vmap`` the height is one number
# per sample, and Python's ``while`` asks a tensor for one truth value: the ``RuntimeError`` of
# data-dependent control flow (:doc:`../guides/plot_pitfalls`, section 2). torchdiffeq's
# ``odeint_event`` reads tensors the same way, as read in its source (not run here: torchdiffeq
# is not installed): its adaptive solvers choose a first step with an ``if`` on a norm
# (``_select_initial_step``) and step while the event function keeps its sign
# (``_advance_until_event``), a ``while`` like the one below; and it runs through
# ``autograd.Function`` classes without ``setup_context``, which ``vmap`` also refuses
# (:doc:`../guides/plot_troubleshooting_arguments`).
def landing_by_loop(angle):
    state = launch(angle)
    while state[1] > 0:
        state = runge_kutta_step(state, DRAG)
    return state


try:
    vmap(landing_by_loop)(angles)
    raise AssertionError("vmap ran a while loop on a tensor")
except RuntimeError as stopped:
    message = str(stopped)
    assert type(stopped) is RuntimeError, type(stopped)
    assert message.startswith("vmap: It looks like you're attempting to use a Tensor in some "
                              "data-dependent control flow"), message  # fmt: skip
    print("  RuntimeError:", message.split(". ")[0])

# %%
# What the batch costs
# --------------------
# Every sample takes all ``STEPS`` steps: the frozen ones still compute theirs, then discard
# them. Counted from the times of flight: the share of steps that moved a ball still in the air;
# a shorter ``STEPS`` (the longest flight plus one step) wastes less. Timed, the forward solve
# only, on 4 and on 64 angles: ``vmap`` of ``landing``; SciPy's adaptive solver in a loop (its
# own steps, at tolerances of 1e-12, in NumPy: a more accurate answer than the fixed steps'); and,
# on 4 angles, a Python loop of ``landing``.
# Each on all threads, three rounds in turn after a warm-up, one timed call per round (each
# ``Timer.timeit`` runs the call twice more first, as its own warm-up); medians and ranges.
# Read the two sizes together: the batch runs the same operations on 4 rows as on 64, while a
# loop does one solve per angle.
needed = torch.ceil(flight_times / DT)
used = needed.sum().item() / (STEPS * len(angles))
print(f"  steps that moved a ball in the air: {used:.0%} of {STEPS} x {len(angles)}")
few = angles[::16]
routes = {
    "vmap(landing), 4": lambda: vmap(landing)(few),
    "loop of landing, 4": lambda: [landing(a) for a in few],
    "loop of SciPy, 4": lambda: [scipy_landing(a) for a in few.tolist()],
    "vmap(landing), 64": lambda: vmap(landing)(angles),
    "loop of SciPy, 64": lambda: [scipy_landing(a) for a in angles.tolist()],
}
threads, rounds = torch.get_num_threads(), {name: [] for name in routes}


def one_run(route):  # seconds for one call, on all threads
    timer = benchmark.Timer("route()", globals={"route": route}, num_threads=threads)
    return timer.timeit(1).median


for route in routes.values():
    route()  # warm-up
for _ in range(3):
    for label, route in routes.items():
        rounds[label].append(one_run(route))
medians = {name: float(np.median(times)) for name, times in rounds.items()}
for name, times in rounds.items():
    print(f"  {name:19s} median {medians[name] * 1e3:7.1f} ms "
          f"({min(times) * 1e3:.1f} to {max(times) * 1e3:.1f} ms)")  # fmt: skip
for loop, size in [("loop of landing", 4), ("loop of SciPy", 4), ("loop of SciPy", 64)]:
    ratio = medians[f"{loop}, {size}"] / medians[f"vmap(landing), {size}"]
    worded = f"takes {ratio:.1f}x the time of"
    if ratio < 1:
        worded = f"is {1 / ratio:.1f}x faster than"
    print(f"  {size} angles: the {loop} {worded} vmap(landing)")

# %%
# What to remember
# ----------------
# - An event solve loops until a value crosses zero: under ``vmap`` that loop asks one tensor
#   for one truth value and raises. Step a fixed number of times instead, and freeze each sample
#   at its event with ``torch.where``; locate the crossing inside the step (a Hermite cubic and
#   a few Newton steps), with no ``if`` on a tensor.
# - ``vmap(grad(...))`` differentiates through the frozen steps and the root finding: each
#   sample's derivative of where it lands, checked here against closed forms and SciPy.
# - Every sample pays for all ``STEPS`` steps: fix ``STEPS`` from the longest flight. For
#   landing points alone, time an adaptive solver in a loop against the batch at your size.
# - Where the field is not defined past the event, freeze each sample after it and keep the
#   field's input inside its domain: a NaN in a branch ``torch.where`` does not select still
#   makes the gradient NaN.
