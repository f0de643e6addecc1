// One autograd node, made each way torch allows from C++, for ``bench._nodes`` (built at run time with
// torch.utils.cpp_extension): torch's custom ``torch::autograd::Function``, and a ``Node`` subclass wired by hand, as
// torch's generated code wires its own ops' nodes.  Every op is the identity (in place, or into a new tensor): what is
// timed is the node and the call from Python, not an exchange.
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/utils/pybind.h>

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ``x`` in place (marked dirty), with ``anchor`` (a leaf that requires a gradient) as a second input, as the
// package's ops take one.
struct InPlaceFunction : public torch::autograd::Function<InPlaceFunction> {
    static Tensor
    forward(AutogradContext *ctx, Tensor x, Tensor anchor)
    {
        ctx->mark_dirty({x});
        return x;
    }
    static variable_list
    backward(AutogradContext *ctx, variable_list grads)
    {
        return {grads[0], Tensor()};
    }
};

// A new tensor holding ``x``'s values.
struct NewFunction : public torch::autograd::Function<NewFunction> {
    static Tensor
    forward(AutogradContext *ctx, Tensor x)
    {
        return x.clone();
    }
    static variable_list
    backward(AutogradContext *ctx, variable_list grads)
    {
        return {grads[0]};
    }
};

// The node of both hand-wired ops: the gradient passes through (nothing to the anchor).
struct IdentityBackward : public torch::autograd::Node {
    variable_list
    apply(variable_list &&grads) override
    {
        variable_list out(num_outputs());
        out[0] = grads[0];
        return out;
    }
    std::string
    name() const override
    {
        return "IdentityBackward";
    }
};

static Tensor
function_in_place(Tensor x, Tensor anchor)
{
    return InPlaceFunction::apply(x, anchor);
}

static Tensor
function_new(Tensor x)
{
    return NewFunction::apply(x);
}

static Tensor
node_in_place(Tensor x, Tensor anchor)
{
    torch::autograd::increment_version(x);
    if (torch::autograd::compute_requires_grad(x, anchor)) {
        auto node = c10::make_intrusive<IdentityBackward>();
        node->set_next_edges(torch::autograd::collect_next_edges(x, anchor));
        torch::autograd::rebase_history(x, node);
    }
    return x;
}

static Tensor
node_new(Tensor x)
{
    Tensor y;
    {
        at::AutoDispatchBelowADInplaceOrView below; // the clone records no node of its own
        y = x.clone();
    }
    if (torch::autograd::compute_requires_grad(x)) {
        auto node = c10::make_intrusive<IdentityBackward>();
        node->set_next_edges(torch::autograd::collect_next_edges(x));
        torch::autograd::set_history(y, node);
    }
    return y;
}

static Tensor
call(Tensor x)
{
    return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("function_in_place", &function_in_place);
    m.def("function_new", &function_new);
    m.def("node_in_place", &node_in_place);
    m.def("node_new", &node_new);
    m.def("call", &call);
}
