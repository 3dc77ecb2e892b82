// The Python module of the kernels' build (models/kernels/native.py imports it): the stack step of
// block_step.cpp as a plain function. A torch op's call from Python checks every argument for
// __torch_function__ and converts each list element into the dispatcher's values: for the small
// translator's step that was ~15 us of ~300, more than its embedding and attention together; bound
// directly, the arguments convert once and the step runs without the GIL (the replica's event loop
// goes on while a step computes, as it did during an op's call).

#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<ts::Blocks, std::shared_ptr<ts::Blocks>>(m, "Blocks")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<c10::optional<at::Tensor>>, double, bool, bool,
                          std::vector<at::Tensor>, std::vector<c10::optional<at::Tensor>>, std::vector<int64_t>,
                          std::vector<int64_t>, std::vector<int64_t>, int64_t, bool, int64_t, int64_t, double,
                          int64_t, bool>());
  m.def("stack_step", &ts::stack_step, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "One step of a stack of blocks (block_step.cpp)");
  m.def("beam_top", &ts::beam_top, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "A beam search step's best candidates (select.cpp)");
  m.def("search_select", &ts::search_select, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "A search step's candidates from the decoder's logits (select.cpp)");
  m.def("copy_blocks", &ts::copy_blocks, pybind11::call_guard<pybind11::gil_scoped_release>(), "Blocks of a paged pool copied into others (pool.cpp)");
}
