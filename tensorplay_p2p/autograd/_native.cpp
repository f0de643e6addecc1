// The native autograd node of ``halo_exchange_`` (``autograd._native`` builds it against the installed torch).
//
// A ``torch.autograd.Function`` costs about 3 us a call in Python, more than a small exchange's whole persistent
// step: the package's in-place exchange instead records this node, wired as torch's generated code wires its own
// in-place ops' nodes (``check_inplace``, ``increment_version``, ``collect_next_edges``, ``rebase_history``).  The
// exchange itself has run before (``Plan.run``, in Python and the compiled engine); this records only the node.
//
// Its backward is the exchange's adjoint, run by the Python function ``set_adjoint`` installed (the same one the
// Python node's backward runs: ``autograd._halo.adjoint``), with the GIL held.  The node holds the exchange's plan
// (a Python object) and its call number, and takes the anchor as its second input, as the Python node does.
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/profiler/api.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;
using at::Tensor;
using torch::autograd::variable_list;

static PyObject *adjoint = nullptr; // owned: autograd._halo.adjoint(grad, plan, call)

struct HaloExchangeInPlaceBackward : public torch::autograd::Node {
    PyObject *plan = nullptr; // owned
    int64_t call = 0;

    variable_list
    apply(variable_list &&grads) override
    {
        py::gil_scoped_acquire gil;
        if (adjoint == nullptr || plan == nullptr)
            throw std::runtime_error("halo_exchange_: its backward ran after the interpreter's end, or twice freed");
        py::object grad = grads[0].defined() ? py::cast(grads[0]) : py::none();
        py::object number = py::reinterpret_steal<py::object>(PyLong_FromLongLong(call));
        if (!number)
            throw py::error_already_set();
        PyObject *result = PyObject_CallFunctionObjArgs(adjoint, grad.ptr(), plan, number.ptr(), nullptr);
        if (result == nullptr)
            throw py::error_already_set(); // torch's engine raises it in the backward's caller, as a Python error
        variable_list out(num_outputs());
        out[0] = py::reinterpret_steal<py::object>(result).cast<Tensor>();
        return out;
    }

    std::string
    name() const override
    {
        return "HaloExchangeInPlaceBackward";
    }

    void
    release_variables() override
    {
        // the plan is kept: a second backward pass (retain_graph) runs the same exchange again
    }

    ~HaloExchangeInPlaceBackward() override
    {
        if (plan != nullptr && Py_IsInitialized()) {
            py::gil_scoped_acquire gil;
            Py_CLEAR(plan);
        }
    }
};

// Whether ``fill_in_place`` may record the exchange of ``object``: a ``torch.Tensor`` or ``Parameter`` (no subclass,
// whose torch function the Python node serves) of a dtype that carries a gradient (for integers the Python path records
// no node), no torch.func wrapper (a dead one, left by a finished transform, the Python path unwraps), contiguous, no
// conjugate or negative view (whose history cannot be rebased onto a node), in grad mode, with no torch.func
// transform, profiler or anomaly mode to serve (the Python node serves them).  The forward-mode level, torch.compile's
// tracing and compiled autograd are Python's to check.
static bool
recordable(py::handle object)
{
    PyObject *o = object.ptr();
    if (!THPVariable_CheckExact(o))
        return false;
    const Tensor &x = THPVariable_Unpack(o);
    const auto keys = x.key_set();
    const auto included = c10::impl::tls_local_dispatch_key_set().included_;
    return (at::isFloatingType(x.scalar_type()) || at::isComplexType(x.scalar_type())) &&
           !keys.has(c10::DispatchKey::FuncTorchGradWrapper) && !keys.has(c10::DispatchKey::FuncTorchBatched) &&
           at::GradMode::is_enabled() && !included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) &&
           !included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode) &&
           !torch::profiler::impl::profilerEnabled() && !torch::autograd::AnomalyMode::is_enabled() &&
           x.is_contiguous() && !x.is_conj() && !x.is_neg();
}

// Record ``x``'s in-place exchange (already run) in autograd: ``x``'s version moves on and its history becomes the
// node, whose inputs are ``x``'s previous history and ``anchor``.  Raises torch's own error where ``x`` may not be
// written in place (a leaf that requires a gradient, a view of one), as torch's in-place ops do.
//
// The order is torch's own in-place ops': check, the edges, the version, the history.  The edges are taken before
// the version moves on: a view's history read after it would be made anew at the new version, over its base's old
// history, and then stay as it is when the base's is rebased (the view's backward would skip the exchange).
static Tensor
fill_in_place(Tensor x, const Tensor &anchor, py::handle plan, int64_t call)
{
    try {
        torch::autograd::check_inplace(x, true);
    } catch (...) {
        torch::autograd::increment_version(x); // written all the same: a tensor saved before it is caught at backward
        throw;
    }
    auto edges = torch::autograd::collect_next_edges(x, anchor);
    torch::autograd::increment_version(x);
    auto node = c10::make_intrusive<HaloExchangeInPlaceBackward>();
    node->plan = plan.inc_ref().ptr();
    node->call = call;
    node->set_next_edges(std::move(edges));
    torch::autograd::rebase_history(x, node);
    return x;
}

static void
set_adjoint(py::object function)
{
    PyObject *old = adjoint;
    adjoint = function.inc_ref().ptr();
    Py_XDECREF(old);
}

// The contract with ``autograd._native``: it loads a build whose ``CONTRACT`` is the one it expects, or none.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.attr("CONTRACT") = 1;
    m.def("recordable", &recordable);
    m.def("fill_in_place", &fill_in_place);
    m.def("set_adjoint", &set_adjoint);
}
