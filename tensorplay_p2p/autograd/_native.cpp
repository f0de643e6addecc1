// The native autograd nodes of ``halo_exchange`` and ``halo_exchange_`` (``autograd._native`` builds them against the
// installed torch).
//
// A ``torch.autograd.Function`` costs about 3 us a call in Python, more than a small exchange's whole persistent
// step: the package's exchanges instead record these nodes, wired as torch's generated code wires its own ops' nodes.
// Each exchange's forward is one call from Python (``exchange_by``), which finds the exchange's plan (kept here for the
// arguments the program gave, else given by Python), runs the exchange (the compiled engine's pass run from here with
// no Python, the call numbered and its slot claimed here as ``Plan.fill`` does, where the engine takes it; else
// ``Plan.fill``) and then records the node:
//
// - ``halo_exchange_`` (``fill_in_place``): in torch's order for an in-place op (``check_inplace``,
//   ``collect_next_edges``, ``increment_version``, ``rebase_history``).
// - ``halo_exchange`` (``fill_out_of_place``): the result, a copy the exchange filled (``copy``), gets the node as
//   its history (``set_history``), and the input's guard (``autograd._graph.guard``, natively: ``guard``) takes the
//   node's duty: a hook on the input's gradient that runs the exchange's backward where a backward pass reaches the
//   input but not the node.
//
// Their backward is the exchange's adjoint: in a first-order backward the plan's pass alone, on the gradient where
// nothing else holds it, else on its copy (the compiled engine's pass run from here with no Python, the slot claimed
// here as ``Plan.fill_adjoint`` claims it, where the engine takes it; else ``Plan.fill_adjoint``); else the Python
// function ``set_functions`` installed (the one the Python nodes' backward runs: ``autograd._halo.adjoint``,
// differentiable in turn), with the GIL held.  A node holds the exchange's plan (a Python object) and its call number.
// It takes no anchor (the Python node's last input, ``autograd._graph.anchor``): it is made its output's history
// whatever its input requires, so every member's backward runs it, and an anchor's edge would only cost the engine one
// more node to run.
#include <ATen/CachedTensorUtils.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/profiler/api.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <iterator>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace py = pybind11;
using at::Tensor;
using torch::autograd::variable_list;

static PyObject *adjoint = nullptr;    // owned: autograd._halo.adjoint(grad, plan, call)
static PyObject *substitute = nullptr; // owned: autograd._halo._substitute(plan, call)
static PyObject *fill_name = nullptr, *fill_as_name = nullptr, *fill_adjoint_name = nullptr, *failed_name = nullptr,
                *native_name = nullptr, *acquire_name = nullptr, *release_name = nullptr, *halo_calls_name = nullptr,
                *backward_hooks_name = nullptr, *reversed_name = nullptr, *communicator_name = nullptr,
                *group_name = nullptr; // the Python names it reads and calls; held for good

// The compiled engine's passes for a caller that runs no Python (``_accel.c``'s ``native_api`` capsule, as it
// declares it), handed over by ``set_engine``; none with the pure-Python engine.
static const char *const NATIVE_API = "tensorplay_p2p._src.engine._accel.native_api";
struct NativeApi {
    int version; // 1
    int (*halo_may_run)(PyObject *group);
    PyObject *(*halo_run)(PyObject *pass, PyObject *group, void *flat);
};
static const NativeApi *native_api = nullptr;

// How many lean adjoints ran in place on the gradient they were given, and how many on its copy; how many of them ran
// the engine's compiled pass from here, with no Python; and how many forward passes did (``counts``).
static std::atomic<int64_t> adjoints_in_place{0}, adjoints_copied{0}, adjoints_without_python{0},
    forwards_without_python{0};

// Whether ``x`` is a plain tensor that nothing above autograd serves: no Python key, torch.func wrapper or batch,
// no torch.func transform active, no conjugate or negative view (the Python node serves them all).  What the forward
// (``serves``) and a lean backward (``lean``) both ask.
static bool
plain(const Tensor &x)
{
    const auto keys = x.key_set();
    const auto included = c10::impl::tls_local_dispatch_key_set().included_;
    return !keys.has(c10::DispatchKey::Python) && !keys.has(c10::DispatchKey::FuncTorchGradWrapper) &&
           !keys.has(c10::DispatchKey::FuncTorchBatched) &&
           !included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) &&
           !included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode) && !x.is_conj() && !x.is_neg();
}

// Whether ``x``'s bytes are its values, in its shape's order, in memory of its own: a plain contiguous host tensor
// (``plain``: no conjugate or negative view, no Python tensor), not a zero tensor (which has no memory), nor a nested,
// quantized or functional one.
static bool
bytes_are_values(const Tensor &x)
{
    return plain(x) && x.is_cpu() && x.layout() == at::kStrided && x.is_contiguous() && !x.is_quantized() &&
           !x.is_nested() && !x._is_zerotensor() && !x.key_set().has(c10::DispatchKey::Functionalize) &&
           x.has_storage() && (x.nbytes() == 0 || x.const_data_ptr() != nullptr);
}

// A new contiguous copy of ``x`` with no history: what ``halo_exchange``'s exchange fills, before
// ``fill_out_of_place`` records it, and what a lean adjoint adds into where the gradient is not its own (``owned``).
// Where its bytes are its values, they are copied into a new tensor (``clone``'s copy kernel costs several
// microseconds more a call on a small block), unless the kernel would split the copy among torch's threads (more
// elements than its grain, and more than one thread); any other tensor is cloned.
static Tensor
copy(const Tensor &x)
{
    at::AutoDispatchBelowADInplaceOrView below; // no autograd: the node is recorded after the exchange
    if (!bytes_are_values(x) || (x.numel() > at::internal::GRAIN_SIZE && at::get_num_threads() > 1))
        return x.clone(at::MemoryFormat::Contiguous);
    Tensor y = at::empty(x.sizes(), x.options()); // its bytes copied: clone's copy kernel costs more on small blocks
    if (x.nbytes() > 0)
        std::memcpy(y.data_ptr(), x.const_data_ptr(), x.nbytes());
    return y;
}

// ``step()`` (1: done, 0: not; -1 with a Python error) under ``lock`` (a ``threading.Lock``, taken as Python's ``with``
// takes it: its wait lets other threads run), with the GIL held: whether it was done.  An error raises.
template <typename Step>
static bool
locked(PyObject *lock, Step step)
{
    PyObject *taken = PyObject_CallMethodNoArgs(lock, acquire_name);
    if (taken == nullptr)
        throw py::error_already_set();
    Py_DECREF(taken);
    const int done = step();
    if (done < 0) {
        {
            py::error_scope pending; // the step's error, restored once the lock is released
            Py_XDECREF(PyObject_CallMethodNoArgs(lock, release_name));
            PyErr_Clear();
        }
        throw py::error_already_set();
    }
    PyObject *released = PyObject_CallMethodNoArgs(lock, release_name);
    if (released == nullptr)
        throw py::error_already_set();
    Py_DECREF(released);
    return done == 1;
}

// What a plan holds for the passes run from here with no Python (``Plan.native``, read with the GIL held, fixed for the
// plan's life): the group's lock, its set of busy slots, the group, the group's ``Side`` (whose ``halo_calls`` numbers
// its exchanges), and for each pass (0: forward, 1: backward) its compiled passes by slot (a list: None until made)
// and the slots' keys in the busy set.
struct Lean {
    py::object native; // the tuple, held while this lives
    PyObject *lock, *busy, *group, *side;
    PyObject *kernels[2], *keys[2];

    explicit Lean(PyObject *plan) : native(py::reinterpret_steal<py::object>(PyObject_GetAttr(plan, native_name)))
    {
        if (!native)
            throw py::error_already_set();
        PyObject *t = native.ptr();
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 6 ||
            !pair(PyTuple_GET_ITEM(t, 4), [](PyObject *o) { return PyList_Check(o) != 0; }) ||
            !pair(PyTuple_GET_ITEM(t, 5), [](PyObject *o) { return PyTuple_Check(o) != 0; }))
            throw std::runtime_error("halo_exchange: the plan's native entry is not what the native nodes read");
        lock = PyTuple_GET_ITEM(t, 0);
        busy = PyTuple_GET_ITEM(t, 1);
        group = PyTuple_GET_ITEM(t, 2);
        side = PyTuple_GET_ITEM(t, 3);
        for (int backward = 0; backward < 2; ++backward) {
            kernels[backward] = PyTuple_GET_ITEM(PyTuple_GET_ITEM(t, 4), backward);
            keys[backward] = PyTuple_GET_ITEM(PyTuple_GET_ITEM(t, 5), backward);
            if (PyList_GET_SIZE(kernels[backward]) == 0 ||
                PyList_GET_SIZE(kernels[backward]) != PyTuple_GET_SIZE(keys[backward]))
                throw std::runtime_error("halo_exchange: the plan's native entry is not what the native nodes read");
        }
    }

    // Claim the slot of call ``number``'s pass (``backward``) where its compiled pass is made and free, under the lock
    // (``Plan._claim``): the pass, or None where nothing was claimed.  ``number``: the call's, or -1 for the group's
    // next call, which the claim then numbers (``Plan.fill``), into ``number`` (left -1 where nothing was claimed).
    py::object
    claim(int64_t &number, bool backward) const
    {
        py::object kernel;
        locked(lock, [&] {
            int64_t call = number;
            if (call < 0) {
                PyObject *calls = PyObject_GetAttr(side, halo_calls_name);
                if (calls == nullptr)
                    return -1;
                call = PyLong_AsLongLong(calls);
                Py_DECREF(calls);
                if (call == -1 && PyErr_Occurred())
                    return -1;
            }
            const Py_ssize_t slot = static_cast<Py_ssize_t>(call % PyList_GET_SIZE(kernels[backward]));
            PyObject *made = PyList_GET_ITEM(kernels[backward], slot), *key = PyTuple_GET_ITEM(keys[backward], slot);
            if (made == Py_None)
                return 0;
            const int in = PySet_Contains(busy, key);
            if (in != 0)
                return in < 0 ? -1 : 0; // busy: not claimed
            if (PySet_Add(busy, key) < 0)
                return -1;
            if (number < 0) { // the number taken with the slot, as Python takes both in one go
                PyObject *next = PyLong_FromLongLong(call + 1);
                if (next == nullptr || PyObject_SetAttr(side, halo_calls_name, next) < 0) {
                    Py_XDECREF(next);
                    py::error_scope pending;
                    PySet_Discard(busy, key);
                    PyErr_Clear();
                    return -1;
                }
                Py_DECREF(next);
                number = call;
            }
            kernel = py::reinterpret_borrow<py::object>(made);
            return 1;
        });
        return kernel ? kernel : py::none();
    }

    // Run ``kernel``, the claimed pass of call ``number`` (``backward``), on the contiguous host memory at ``flat``
    // through the engine (``native_api``'s ``halo_run``), its slot released at the end whatever happens, as
    // ``Plan._fill`` releases it in its ``finally``: None, NotImplemented (nothing done), or the failure's result.
    py::object
    run(const py::object &kernel, int64_t number, bool backward, void *flat) const
    {
        PyObject *key =
            PyTuple_GET_ITEM(keys[backward], static_cast<Py_ssize_t>(number % PyTuple_GET_SIZE(keys[backward])));
        Claim claim{lock, busy, key};
        py::object result = py::reinterpret_steal<py::object>(native_api->halo_run(kernel.ptr(), group, flat));
        if (!result)
            throw py::error_already_set(); // the error taken before the release
        return result;
    }

  private:
    template <typename Check>
    static bool
    pair(PyObject *o, Check check)
    {
        return PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 2 && check(PyTuple_GET_ITEM(o, 0)) &&
               check(PyTuple_GET_ITEM(o, 1));
    }

    // A slot claimed in ``busy`` (a set) under ``lock``, released when it goes; an error pending then is kept, and one
    // the release itself raises is reported as unraisable.
    struct Claim {
        PyObject *lock, *busy, *key; // borrowed: the caller holds them

        ~Claim()
        {
            py::error_scope pending;
            try {
                locked(lock, [&] { return PySet_Discard(busy, key) < 0 ? -1 : 1; });
            } catch (py::error_already_set &error) {
                error.discard_as_unraisable("halo_exchange: releasing the slot of a pass");
            }
        }
    };
};

static py::object
as_int(int64_t number)
{
    py::object out = py::reinterpret_steal<py::object>(PyLong_FromLongLong(number));
    if (!out)
        throw py::error_already_set();
    return out;
}

// ``plan.method(args...)`` with the GIL held: its result; a Python error raises.
template <typename... Args>
static py::object
call_method(PyObject *plan, PyObject *method, Args... args)
{
    PyObject *result = PyObject_CallMethodObjArgs(plan, method, args..., nullptr);
    if (result == nullptr)
        throw py::error_already_set(); // torch's engine raises it in the backward's caller, as a Python error
    return py::reinterpret_steal<py::object>(result);
}

// Raise the error of call ``number``'s pass that the engine ran from here and that failed (``result``: what it
// returned; its slot released), worded by ``plan.failed`` as the Python pass words it.
[[noreturn]] static void
raise_failed(PyObject *plan, int64_t number, bool backward, const py::object &result)
{
    call_method(plan, failed_name, as_int(number).ptr(), backward ? Py_True : Py_False, result.ptr());
    throw std::runtime_error("halo_exchange: the plan's failed returned instead of raising");
}

// What ``lean_pass`` did with a pass.
enum class Went {
    done,    // run by the engine from here, with no Python
    handed,  // claimed, then handed back by the engine (nothing done): the Python pass runs it as the same call
    skipped, // nothing claimed (no engine, not host memory, the engine would not take it, no compiled pass, busy)
};

// ``Plan._fill``'s common case with no Python code run, with the GIL held: where the engine takes a whole pass on the
// plan's group now (``native_api``'s ``halo_may_run``: its gate, which includes the thread rule, no timeout, a live
// group; asked before the claim, as Python asks before it claims), the slot of call ``number``'s pass (``backward``;
// ``number`` -1: the group's next call, numbered by the claim) claimed on the group under its lock where its compiled
// pass is made and free (``Lean::claim``), the pass run by the engine on ``t`` (contiguous, of the plan's shape,
// plain), the slot released.  A failed pass raises, worded by ``plan.failed``.
static Went
lean_pass(PyObject *plan, int64_t &number, bool backward, const Tensor &t)
{
    if (native_api == nullptr || !t.is_cpu()) // the engine's passes are host memory's
        return Went::skipped;
    const Lean lean(plan);
    const int may = native_api->halo_may_run(lean.group);
    if (may <= 0) {
        if (may < 0)
            throw py::error_already_set();
        return Went::skipped;
    }
    void *flat = t.data_ptr();
    py::object kernel = lean.claim(number, backward);
    if (kernel.is_none())
        return Went::skipped;
    py::object result = lean.run(kernel, number, backward, flat);
    if (result.is_none()) {
        (backward ? adjoints_without_python : forwards_without_python).fetch_add(1, std::memory_order_relaxed);
        return Went::done;
    }
    if (result.ptr() != Py_NotImplemented)
        raise_failed(plan, number, backward, result);
    return Went::handed;
}

// H in place on ``x`` (contiguous, of the plan's shape, plain) as the group's next halo exchange, with the GIL held,
// and its number: ``Plan.fill``'s common case with no Python code run (``lean_pass``: the number taken and the forward
// slot claimed in one go), else ``plan.fill(x)``, which numbers it, runs it, or says why it cannot; a pass the engine
// hands back after the claim runs in Python as the same call (``plan.fill_as``).
static int64_t
fill(PyObject *plan, const Tensor &x)
{
    int64_t number = -1;
    const Went went = lean_pass(plan, number, false, x);
    if (went == Went::done)
        return number;
    py::object given = py::cast(x);
    if (went == Went::handed) {
        call_method(plan, fill_as_name, given.ptr(), as_int(number).ptr());
        return number;
    }
    return call_method(plan, fill_name, given.ptr()).cast<int64_t>();
}

// A plan and a call number: what the adjoint and the substitute take.  The plan is released with the GIL, while the
// interpreter lives.
struct Call {
    PyObject *plan = nullptr; // owned
    int64_t number = 0;

    Call(py::handle plan_, int64_t number_) : plan(plan_.inc_ref().ptr()), number(number_) {}
    Call(const Call &) = delete;
    Call &operator=(const Call &) = delete;

    ~Call()
    {
        if (plan != nullptr && Py_IsInitialized()) {
            py::gil_scoped_acquire gil;
            Py_CLEAR(plan);
        }
    }

    // ``function(plan, number)``, or ``function(grad, plan, number)`` where ``grad`` is given (None where it is
    // undefined), with the GIL held: its tensor, or a Python error.
    Tensor
    run(PyObject *function, const char *what, const Tensor *grad = nullptr) const
    {
        py::gil_scoped_acquire gil;
        if (function == nullptr || plan == nullptr)
            throw std::runtime_error(std::string(what) + ": its backward ran after the interpreter's end");
        py::object number_ = as_int(number);
        PyObject *result =
            grad != nullptr ? PyObject_CallFunctionObjArgs(function, grad->defined() ? py::cast(*grad).ptr() : Py_None,
                                                           plan, number_.ptr(), nullptr)
                            : PyObject_CallFunctionObjArgs(function, plan, number_.ptr(), nullptr);
        if (result == nullptr)
            throw py::error_already_set(); // torch's engine raises it in the backward's caller, as a Python error
        return py::reinterpret_steal<py::object>(result).cast<Tensor>();
    }

    // H* in place on ``y`` (contiguous, of the plan's shape, plain), with the GIL held: ``Plan.fill_adjoint``'s common
    // case with no Python code run (``lean_pass``), else ``plan.fill_adjoint(y, number)``, which runs it or says why
    // it cannot.
    void
    fill_adjoint(const Tensor &y) const
    {
        py::gil_scoped_acquire gil;
        if (plan == nullptr)
            throw std::runtime_error("halo_exchange: its backward ran after the interpreter's end");
        int64_t call = number;
        if (lean_pass(plan, call, true, y) == Went::done)
            return;
        py::object given = py::cast(y);
        call_method(plan, fill_adjoint_name, given.ptr(), as_int(number).ptr());
    }
};

// What an out-of-place exchange's backward owes its peers (``autograd._graph.Duty``): how many backward passes ran
// its node and were not yet seen by the input's guard, whether it ever ran, and whether the node is still alive.  It
// holds its exchange's call weakly while the node lives (a node that ran and is freed owes nothing: its plan goes with
// it), and strongly once a node that never ran is freed (its backward is still owed).
struct Duty {
    std::atomic<int64_t> ran{0};
    std::atomic<bool> ever_ran{false};
    std::atomic<bool> alive{true};
    std::mutex lock; // ``kept``'s
    std::weak_ptr<Call> call;
    std::shared_ptr<Call> kept;

    explicit Duty(const std::shared_ptr<Call> &call_) : call(call_) {}
    Duty(const Duty &) = delete;
    Duty &operator=(const Duty &) = delete;

    // Its node has run in this pass and not yet been seen: take it (once).
    bool
    take_ran()
    {
        int64_t now = ran.load();
        while (now > 0 && !ran.compare_exchange_weak(now, now - 1)) {
        }
        return now > 0;
    }

    bool
    settled() const // its node ran and is gone: nothing more is owed
    {
        return ever_ran && !alive;
    }

    // The backward owed, with zero output gradients: what it receives, as the input's gradient.
    Tensor
    substitute_owed()
    {
        std::shared_ptr<Call> owed;
        {
            std::lock_guard<std::mutex> held(lock);
            owed = kept ? kept : call.lock();
        }
        if (!owed)
            throw std::runtime_error("halo_exchange: the guard owes the backward of an exchange it no longer holds");
        return owed->run(substitute, "halo_exchange");
    }

    // Its node is freed (``~HaloExchangeBackward``): keep the call where its backward is still owed.  The guard that
    // holds the duty drops it, once settled, at its next sweep.
    void
    node_freed(const std::shared_ptr<Call> &node_call)
    {
        std::lock_guard<std::mutex> held(lock);
        if (!ever_ran)
            kept = node_call;
        alive = false;
    }
};

struct HaloExchangeBackwardBase : public torch::autograd::Node {
    std::shared_ptr<Call> call;

    variable_list
    apply(variable_list &&grads) override
    {
        variable_list out(num_outputs());
        if (lean(grads[0])) {
            Tensor grad = std::move(grads[0]);
            if (owned(grad)) {
                adjoints_in_place.fetch_add(1, std::memory_order_relaxed);
            } else {
                grad = copy(grad);
                adjoints_copied.fetch_add(1, std::memory_order_relaxed);
            }
            call->fill_adjoint(grad);
            out[0] = std::move(grad);
            return out;
        }
        out[0] = call->run(adjoint, "halo_exchange", &grads[0]);
        return out;
    }

    // Whether the adjoint of ``grad`` is the plan's pass alone, on it or its copy (``Plan.fill_adjoint``): a
    // first-order backward (grad mode off: no node to record), a plain tensor with no tangent, no conjugate or
    // negative view, no torch.func transform or profiler to serve.  Else the Python adjoint, as the Python node's
    // backward.
    static bool
    lean(const Tensor &grad)
    {
        return grad.defined() && !at::GradMode::is_enabled() && !torch::profiler::impl::profilerEnabled() &&
               plain(grad) && !grad._fw_grad(0).defined();
    }

    // Whether the lean adjoint may run in place on ``grad``, as it came from the engine: contiguous, and no other
    // tensor holds it or its memory.  torch's engine's own rule for adding into a gradient in place
    // (``can_accumulate_inplace``): a gradient a hook, a capture of ``torch.autograd.grad`` or the program (a root
    // gradient it passed) still holds, or a view of another's memory, is copied first.  Stricter than torch's: the
    // memory is torch's own (resizable), not another library's that torch only borrows (``from_numpy``, DLPack).
    static bool
    owned(const Tensor &grad)
    {
        return grad.is_contiguous() && !grad.is_nested() && !grad._is_zerotensor() &&
               at::caching::adjusted_use_count(grad) == 1 && grad.has_storage() && grad.storage().use_count() == 1 &&
               grad.storage().resizable();
    }

    // the plan is kept on release_variables (the base's): a second backward pass (retain_graph) runs it again
};

struct HaloExchangeInPlaceBackward : public HaloExchangeBackwardBase {
    std::string
    name() const override
    {
        return "HaloExchangeInPlaceBackward";
    }
};

struct HaloExchangeBackward : public HaloExchangeBackwardBase {
    std::shared_ptr<Duty> duty; // none where the input needs no gradient

    variable_list
    apply(variable_list &&grads) override
    {
        variable_list out = HaloExchangeBackwardBase::apply(std::move(grads));
        if (duty) { // once its adjoint ran (one refused or failed leaves its duty to the input's guard)
            duty->ever_ran = true;
            duty->ran += 1; // this pass ran the node: the input's guard lets the gradient through as it is
        }
        return out;
    }

    std::string
    name() const override
    {
        return "HaloExchangeBackward";
    }

    ~HaloExchangeBackward() override
    {
        if (duty)
            duty->node_freed(call);
    }
};

static PyObject *ordered_dict = nullptr; // collections.OrderedDict, as torch's own hook dicts; held for good

// A guard of a tensor's gradient (``autograd._graph.guard``): duties of the tensor's exchanges, in the order
// they were made.  On each backward pass that reaches the tensor, a duty whose node ran in this pass is let through;
// one whose node ran and is gone is dropped; any other (its node dropped before it ran, or alive and not reached by
// this pass) runs its exchange's backward with zero output gradients, and what it receives is added into the
// tensor's gradient; a freed node's duty is dropped once its backward ran.  Duties leave under the lock and are freed
// after it: freeing one may take the GIL.
struct Guard {
    std::mutex lock;
    std::vector<std::shared_ptr<Duty>> duties;
    size_t sweep_at = 8; // the count of duties at which ``add`` drops the settled ones: amortized, a constant a call

    void
    add(std::shared_ptr<Duty> duty)
    {
        std::vector<std::shared_ptr<Duty>> gone;
        std::lock_guard<std::mutex> held(lock);
        if (duties.size() >= sweep_at) {
            take_settled(gone);
            sweep_at = 2 * duties.size() + 8;
        }
        duties.push_back(std::move(duty));
    }

    // The duties not yet settled (those settled dropped).
    size_t
    held()
    {
        std::vector<std::shared_ptr<Duty>> gone;
        std::lock_guard<std::mutex> locked(lock);
        take_settled(gone);
        return duties.size();
    }

    // ``grad`` (undefined where none reached the tensor) with what this pass owes added in: whether anything was.
    bool
    pass(Tensor &grad)
    {
        std::vector<std::shared_ptr<Duty>> gone, owed;
        {
            std::lock_guard<std::mutex> held(lock);
            take_settled(gone);
            for (const auto &d : duties)
                if (!d->take_ran())
                    owed.push_back(d);
        }
        for (const auto &d : owed) {
            Tensor received = d->substitute_owed(); // an error leaves the duty: the next pass runs it again
            grad = grad.defined() ? grad.add(received) : received;
            if (!d->alive) { // a freed node's backward runs once
                std::lock_guard<std::mutex> held(lock);
                duties.erase(std::remove(duties.begin(), duties.end(), d), duties.end());
            }
        }
        return !owed.empty();
    }

  private:
    void
    take_settled(std::vector<std::shared_ptr<Duty>> &gone) // under ``lock``
    {
        auto settled = std::stable_partition(duties.begin(), duties.end(),
                                             [](const std::shared_ptr<Duty> &d) { return !d->settled(); });
        std::move(settled, duties.end(), std::back_inserter(gone));
        duties.erase(settled, duties.end());
    }
};

// The guard on a non-leaf's gradient where the tensor has no hook dict: a hook of its node, at the tensor's place
// among that node's inputs (``guard`` adds to it only while the tensor has no hook dict, so that no hook of the
// program's comes between its duties).
struct GuardHook : public torch::autograd::FunctionPreHook {
    const size_t index;
    Guard guard;

    explicit GuardHook(size_t index_) : index(index_) {}

    variable_list
    operator()(const variable_list &grads) override
    {
        if (index >= grads.size())
            return grads;
        Tensor grad = grads[index];
        if (!guard.pass(grad))
            return grads;
        variable_list out = grads;
        out[index] = std::move(grad);
        return out;
    }
};

// A guard in a tensor's hook dict (``_backward_hooks``), under itself as its key: torch's hook of the tensor runs it
// with the program's hooks and the Python guards, in the order they were put there.  A leaf's guards are always there
// (its one C++ hook is that dict's: torch replaces it when the dict is set, so a hook of its own would be lost), and a
// non-leaf's where it has a dict.  An exchange adds its duty to the dict's last entry where that is a guard, else to a
// new guard put at the end: each duty runs at its exchange's place among the hooks, as the Python guard's hook runs.
// A guard stays once its duties are settled (a call that does nothing), so that the next exchange of the tensor only
// adds its duty; those that hold nothing are taken out when a new one is put in.  Marked ``__torch_unserializable__``,
// as torch's ``unserializable_hook`` marks a hook that saving the tensor need not warn of.
struct DictGuard {
    PyObject_HEAD
    Guard *guard; // owned: alive while the object is, which its caller holds through a call
};

static PyTypeObject *dict_guard = nullptr; // DictGuard's type; held for good

static void
dict_guard_free(PyObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    delete reinterpret_cast<DictGuard *>(self)->guard; // its duties' calls may take the GIL: it is held
    type->tp_free(self);
    Py_DECREF(type);
}

// torch's hook of the tensor calls it with the tensor's gradient: None (left as it is), or the gradient with what the
// owed backward passes received.
static PyObject *
dict_guard_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    HANDLE_TH_ERRORS
    PyObject *given = nullptr;
    if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "a halo exchange's guard takes the gradient alone, with no keyword");
        return nullptr;
    }
    if (!PyArg_UnpackTuple(args, "a halo exchange's guard", 1, 1, &given))
        return nullptr;
    Guard &guard = *reinterpret_cast<DictGuard *>(self)->guard;
    Tensor grad = THPVariable_Check(given) ? THPVariable_Unpack(given) : Tensor();
    if (!guard.pass(grad))
        Py_RETURN_NONE;
    return THPVariable_Wrap(std::move(grad));
    END_HANDLE_TH_ERRORS
}

// ``guard.owing()``: how many duties it holds that are not settled (the tests' view).
static PyObject *
dict_guard_owing(PyObject *self, PyObject *)
{
    return PyLong_FromSize_t(reinterpret_cast<DictGuard *>(self)->guard->held());
}

static PyMethodDef dict_guard_methods[] = {
    {"owing", dict_guard_owing, METH_NOARGS, "How many duties it holds that are not settled."},
    {nullptr, nullptr, 0, nullptr},
};

static PyType_Slot dict_guard_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void *>(dict_guard_free)},
    {Py_tp_call, reinterpret_cast<void *>(dict_guard_call)},
    {Py_tp_methods, dict_guard_methods},
    {Py_tp_doc,
     const_cast<char *>("The guard of the halo exchanges of a tensor, in its hook dict (autograd._graph.guard).")},
    {0, nullptr},
};

static PyType_Spec dict_guard_spec = {"tensorplay_p2p.autograd._native.Guard", sizeof(DictGuard), 0,
                                      Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, dict_guard_slots};

static Guard &
guard_of(PyObject *entry)
{
    return *reinterpret_cast<DictGuard *>(entry)->guard;
}

// The guard of the next exchange in ``hooks`` (a hook dict, not empty): its last entry where that is a guard (borrowed
// from the dict), else none.
static PyObject *
last_guard(PyObject *hooks)
{
    py::object reversed = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(hooks, reversed_name));
    if (!reversed)
        throw py::error_already_set();
    py::object last = py::reinterpret_steal<py::object>(PyIter_Next(reversed.ptr()));
    if (!last && PyErr_Occurred())
        throw py::error_already_set();
    return last && Py_TYPE(last.ptr()) == dict_guard ? last.ptr() : nullptr; // a guard's key is itself
}

// The guard of the next exchange in ``hooks`` (a hook dict): the last entry where that is a guard, else a new one put
// at the end, once the guards that hold nothing are taken out.
static Guard &
dict_guard_of(PyObject *hooks)
{
    if (PyDict_Check(hooks) && PyDict_GET_SIZE(hooks) > 0) { // an OrderedDict is a dict
        if (PyObject *last = last_guard(hooks))
            return guard_of(last);
        std::vector<py::object> idle;
        PyObject *key, *value;
        Py_ssize_t at = 0;
        while (PyDict_Next(hooks, &at, &key, &value))
            if (Py_TYPE(key) == dict_guard && guard_of(key).held() == 0)
                idle.push_back(py::reinterpret_borrow<py::object>(key));
        for (const auto &entry : idle)
            if (PyObject_DelItem(hooks, entry.ptr()) != 0)
                throw py::error_already_set();
    }
    PyObject *made = PyType_GenericAlloc(dict_guard, 0);
    if (made == nullptr)
        throw py::error_already_set();
    py::object entry = py::reinterpret_steal<py::object>(made);
    reinterpret_cast<DictGuard *>(made)->guard = new Guard();
    if (PyObject_SetItem(hooks, made, made) != 0) // an OrderedDict's own order too
        throw py::error_already_set();
    return guard_of(made); // the dict holds it
}

// Put ``duty`` on ``x`` (``object``'s tensor), as ``autograd._graph.guard`` puts the Python node's: a non-leaf without
// a hook dict gets it in its node's hook (``GuardHook``, one for the tensor, made at its first exchange); otherwise it
// goes into the guard in the tensor's hook dict (``DictGuard``), the dict made where the leaf has none.
static void
guard(py::handle object, const Tensor &x, std::shared_ptr<Duty> duty)
{
    PyObject *hooks = reinterpret_cast<THPVariable *>(object.ptr())->backward_hooks; // borrowed: ``_backward_hooks``
    if (hooks == Py_None)
        hooks = nullptr;
    const auto node = x.grad_fn();
    if (node && hooks == nullptr) {
        const size_t index = x.output_nr();
        for (auto &hook : node->tensor_pre_hooks()) {
            auto *existing = dynamic_cast<GuardHook *>(hook.get());
            if (existing != nullptr && existing->index == index) {
                existing->guard.add(std::move(duty));
                return;
            }
        }
        auto made = std::make_unique<GuardHook>(index);
        made->guard.add(std::move(duty));
        node->add_tensor_pre_hook(std::move(made));
        return;
    }
    if (hooks == nullptr) { // a leaf's first hook
        py::object dict = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(ordered_dict));
        if (!dict || PyObject_SetAttr(object.ptr(), backward_hooks_name, dict.ptr()) != 0)
            throw py::error_already_set(); // torch's setter makes the dict the leaf's hook
        hooks = dict.ptr();                // the tensor holds it
    }
    dict_guard_of(hooks).add(std::move(duty));
}

// What the native forward does with the exchange of ``object`` (``serves``).
enum class Serve {
    python, // nothing: the Python ``Function`` serves it
    alone,  // the exchange alone, with no node: nothing can be differentiated (grad mode off, or integers)
    node,   // the exchange and its native node
};

// How ``exchange_in_place`` and ``exchange`` serve the exchange of ``object``: a ``torch.Tensor`` or ``Parameter``
// (no subclass, whose torch function the Python node serves), no torch.func wrapper (a dead one, left by a finished
// transform, the Python path unwraps), contiguous, no conjugate or negative view (whose history cannot be rebased onto
// a node), with no torch.func transform or profiler to serve (the Python node serves them), or none (python).  Then
// with grad mode off or a dtype that carries no gradient, the exchange alone, as the Python path runs it there (its
// forward alone with grad mode off, ``_function.apply``; its ``Function``, which records no node, on integers); else
// its node, unless anomaly mode is on (the Python node records its traceback).  The forward-mode level,
// torch.compile's tracing and compiled autograd are Python's to check.
static Serve
serves(py::handle object)
{
    PyObject *o = object.ptr();
    if (!THPVariable_CheckExact(o))
        return Serve::python;
    const Tensor &x = THPVariable_Unpack(o);
    if (torch::profiler::impl::profilerEnabled() || !x.is_contiguous() || !plain(x))
        return Serve::python;
    if (!at::GradMode::is_enabled() || !(at::isFloatingType(x.scalar_type()) || at::isComplexType(x.scalar_type())))
        return Serve::alone;
    return torch::autograd::AnomalyMode::is_enabled() ? Serve::python : Serve::node;
}

// Record ``x``'s in-place exchange (already run) in autograd: ``x``'s version moves on and its history becomes the
// node, whose input is ``x``'s previous history.  Raises torch's own error where ``x`` may not be
// written in place (a leaf that requires a gradient, a view of one), as torch's in-place ops do.
//
// The order is torch's own in-place ops': check, the edges, the version, the history.  The edges are taken before
// the version moves on: a view's history read after it would be made anew at the new version, over its base's old
// history, and then stay as it is when the base's is rebased (the view's backward would skip the exchange).
static Tensor
fill_in_place(Tensor x, py::handle plan, int64_t call)
{
    try {
        torch::autograd::check_inplace(x, true);
    } catch (...) {
        torch::autograd::increment_version(x); // written all the same: a tensor saved before it is caught at backward
        throw;
    }
    auto edges = torch::autograd::collect_next_edges(x);
    torch::autograd::increment_version(x);
    auto node = c10::make_intrusive<HaloExchangeInPlaceBackward>();
    node->call = std::make_shared<Call>(plan, call);
    node->set_next_edges(std::move(edges));
    torch::autograd::rebase_history(x, node);
    return x;
}

// Record ``halo_exchange``'s exchange of ``x`` (``object``'s tensor) into ``y`` (``copy(x)``, filled) in autograd:
// ``y``'s history becomes the node, whose input is ``x``'s history; where ``x`` requires a gradient, its guard holds
// the node's duty.
static Tensor
fill_out_of_place(py::handle object, const Tensor &x, const Tensor &y, py::handle plan, int64_t call)
{
    auto node = c10::make_intrusive<HaloExchangeBackward>();
    node->call = std::make_shared<Call>(plan, call);
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    torch::autograd::set_history(y, node);
    if (x.requires_grad()) {
        node->duty = std::make_shared<Duty>(node->call);
        guard(object, x, node->duty);
    }
    return y;
}

// ``halo_exchange_``'s forward as the native code serves it (``how``, not ``python``): ``x`` exchanged in place
// (``fill``), and its node recorded (``fill_in_place``), or where none is, its version moved on as the Python path
// moves it (on integers, the ``Function``'s ``mark_dirty``, which refuses an inference tensor outside inference mode
// after the exchange; with grad mode off, ``_function.apply``'s ``increment_version``, which skips one).
static py::object
exchange_in_place(py::handle object, py::handle plan, Serve how)
{
    const Tensor &x = THPVariable_Unpack(object.ptr());
    const int64_t number = fill(plan.ptr(), x);
    if (how == Serve::node)
        fill_in_place(x, plan, number);
    else if (at::GradMode::is_enabled() || !x.is_inference()) // as the Function's mark_dirty, or ``apply``'s
        torch::autograd::increment_version(x);                // increment_version, which skips an inference tensor
    return py::reinterpret_borrow<py::object>(object);
}

// ``halo_exchange``'s forward as the native code serves it (``how``, not ``python``): a copy of ``x`` (``copy``),
// exchanged (``fill``), with its node recorded (``fill_out_of_place``) where one is.
static py::object
exchange(py::handle object, py::handle plan, Serve how)
{
    const Tensor &x = THPVariable_Unpack(object.ptr());
    Tensor y = copy(x);
    const int64_t number = fill(plan.ptr(), y);
    return py::cast(how == Serve::node ? fill_out_of_place(object, x, y, plan, number) : y);
}

// The plans ``autograd._halo.plan_for`` gave the exchanges lately, by the arguments the program gave (``exchange_by``),
// so that a call whose plan is among them finds it with no Python code run: ``plan_for``'s lookup costs a few
// microseconds, more than this module's whole forward on a small block.  Only a ``halo`` given as an ``int`` and
// ``corners`` as an ``int`` or ``bool`` are kept, read by value (a tuple or a list is found by ``plan_for``, as
// before), and at most ``KNOWN`` entries, the one found or kept longest ago dropped first.  A plan whose group was
// destroyed is dropped when next found (``plan_for`` makes its successor).  Read and written under ``known_lock``,
// which is never held while Python code runs: an entry leaves the list before its objects are released, since a
// plan's release may run Python code.  Never freed: no object is released after the interpreter.
struct Known {
    py::object plan, side; // ``side``: ``plan.side.group``, whose ``communicator`` is None once the group is destroyed
    PyObject *group;       // the plan's own group, which the plan holds
    long long halo;
    bool corners;
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
    at::Device device;
};
static constexpr size_t KNOWN = 16;
static auto *const known = new std::vector<Known>();
static std::mutex known_lock;

// ``number``'s value where it is an ``int``, or with ``flag`` a ``bool`` too, else nothing (a subclass's ``==`` may
// differ; a halo is never a ``bool``: ``plan_for`` refuses one).
static std::optional<long long>
whole(PyObject *number, bool flag)
{
    if (!PyLong_CheckExact(number) && !(flag && PyBool_Check(number)))
        return std::nullopt;
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(number, &overflow);
    if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return std::nullopt;
    }
    return value;
}

// The plan kept for ``x`` on ``group`` with ``halo`` and ``corners``; None where none is.
static py::object
known_plan(const Tensor &x, PyObject *group, PyObject *halo, PyObject *corners)
{
    const auto h = whole(halo, false), c = whole(corners, true);
    if (!h || !c)
        return py::none();
    const auto sizes = x.sizes();
    py::object plan, side;
    {
        const std::lock_guard<std::mutex> hold(known_lock);
        const auto found = std::find_if(known->begin(), known->end(), [&](const Known &entry) {
            return entry.group == group && entry.halo == *h && entry.corners == (*c != 0) &&
                   entry.dtype == x.scalar_type() && entry.device == x.device() &&
                   std::equal(sizes.begin(), sizes.end(), entry.sizes.begin(), entry.sizes.end());
        });
        if (found == known->end())
            return py::none();
        plan = found->plan;
        side = found->side;
        std::rotate(found, found + 1, known->end()); // the last found is the last dropped
    }
    if (!side.attr(communicator_name).is_none())
        return plan;
    std::optional<Known> gone; // released once the lock is
    {
        const std::lock_guard<std::mutex> hold(known_lock);
        const auto dead = std::find_if(known->begin(), known->end(),
                                       [&](const Known &entry) { return entry.plan.ptr() == plan.ptr(); });
        if (dead != known->end()) {
            gone.emplace(std::move(*dead));
            known->erase(dead);
        }
    }
    return py::none();
}

// Keep ``plan`` (``plan_for``'s for ``x`` on ``group`` with ``halo`` and ``corners``) for ``known_plan``, unless kept.
static void
keep(py::handle plan, const Tensor &x, PyObject *group, PyObject *halo, PyObject *corners)
{
    const auto h = whole(halo, false), c = whole(corners, true);
    if (!h || !c || !known_plan(x, group, halo, corners).is_none())
        return;
    if (plan.attr(group_name).ptr() != group) // not the plan of this group: nothing is kept
        return;
    Known entry{py::reinterpret_borrow<py::object>(plan),
                plan.attr("side").attr(group_name),
                group,
                *h,
                *c != 0,
                std::vector<int64_t>(x.sizes().begin(), x.sizes().end()),
                x.scalar_type(),
                x.device()};
    std::optional<Known> oldest; // released once the lock is
    const std::lock_guard<std::mutex> hold(known_lock);
    if (known->size() >= KNOWN) {
        oldest.emplace(std::move(known->front()));
        known->erase(known->begin());
    }
    known->push_back(std::move(entry));
}

// ``halo_exchange``'s forward (``in_place`` false; ``exchange``) or ``halo_exchange_``'s (``exchange_in_place``) on
// ``object`` where the native code serves it (``serves``), from the arguments the program gave: with ``plan`` None, on
// the plan kept for them (``known_plan``), where one is; else on ``plan`` (``plan_for``'s, kept first for the next
// call alike).  Nothing is done where it returns NotImplemented (the Python node serves it) or, with ``plan`` None,
// None (no plan is kept for these arguments).
static py::object
exchange_by(py::handle object, py::handle plan, py::handle group, py::handle halo, py::handle corners, bool in_place)
{
    const Serve how = serves(object);
    if (how == Serve::python)
        return py::reinterpret_borrow<py::object>(Py_NotImplemented);
    const Tensor &x = THPVariable_Unpack(object.ptr());
    py::object given; // held while it runs: a release of the list's entry cannot free it
    if (plan.is_none()) {
        given = known_plan(x, group.ptr(), halo.ptr(), corners.ptr());
        if (given.is_none())
            return given;
    } else {
        keep(plan, x, group.ptr(), halo.ptr(), corners.ptr());
        given = py::reinterpret_borrow<py::object>(plan);
    }
    return in_place ? exchange_in_place(object, given, how) : exchange(object, given, how);
}

// What the lean adjoints did in this process: ``{"in place": n, "copied": m, "without Python": k}`` (on a gradient that
// nothing else held, or on its copy; and of them, those whose compiled pass ran from here with no Python), and
// ``"forward without Python"``: the forward passes that did; ``"plans kept"``: the plans ``known_plan`` finds.  Python
// cannot see the first two otherwise: a tensor it has seen keeps a second reference, and is copied.
static py::dict
counts()
{
    py::dict out;
    out["in place"] = adjoints_in_place.load();
    out["copied"] = adjoints_copied.load();
    out["without Python"] = adjoints_without_python.load();
    out["forward without Python"] = forwards_without_python.load();
    {
        const std::lock_guard<std::mutex> hold(known_lock);
        out["plans kept"] = known->size();
    }
    return out;
}

static void
set_functions(py::object adjoint_, py::object substitute_)
{
    PyObject *old_adjoint = adjoint, *old_substitute = substitute;
    adjoint = adjoint_.inc_ref().ptr();
    substitute = substitute_.inc_ref().ptr();
    Py_XDECREF(old_adjoint);
    Py_XDECREF(old_substitute);
}

// The compiled engine's ``native_api`` capsule, whose passes the forward and the lean adjoint run with no Python; None:
// none (the pure-Python engine), ``Plan.fill`` runs every forward and ``Plan.fill_adjoint`` every lean adjoint.
static void
set_engine(py::object api)
{
    if (api.is_none()) {
        native_api = nullptr;
        return;
    }
    const auto *given = static_cast<const NativeApi *>(PyCapsule_GetPointer(api.ptr(), NATIVE_API));
    if (given == nullptr)
        throw py::error_already_set();
    if (given->version != 1)
        throw py::value_error("set_engine: the engine's native_api is of another version than these nodes read");
    native_api = given;
}

// The contract with ``autograd._native``: it loads a build whose ``CONTRACT`` is the one it expects, or none.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.attr("CONTRACT") = 6;
    m.def("exchange_by", &exchange_by);
    m.def("set_functions", &set_functions);
    m.def("set_engine", &set_engine);
    m.def("counts", &counts);
    ordered_dict = py::object(py::module_::import("collections").attr("OrderedDict")).release().ptr();
    dict_guard = reinterpret_cast<PyTypeObject *>(PyType_FromSpec(&dict_guard_spec));
    if (dict_guard == nullptr ||
        PyObject_SetAttrString(reinterpret_cast<PyObject *>(dict_guard), "__torch_unserializable__", Py_True) != 0)
        throw py::error_already_set();
    m.attr("Guard") = py::handle(reinterpret_cast<PyObject *>(dict_guard));
    for (auto [name, text] : {std::pair{&fill_name, "fill"},
                              {&fill_as_name, "fill_as"},
                              {&fill_adjoint_name, "fill_adjoint"},
                              {&failed_name, "failed"},
                              {&native_name, "native"},
                              {&acquire_name, "acquire"},
                              {&release_name, "release"},
                              {&halo_calls_name, "halo_calls"},
                              {&backward_hooks_name, "_backward_hooks"},
                              {&reversed_name, "__reversed__"},
                              {&communicator_name, "communicator"},
                              {&group_name, "group"}}) {
        *name = PyUnicode_InternFromString(text);
        if (*name == nullptr)
            throw py::error_already_set();
    }
}
