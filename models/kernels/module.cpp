// The Python module of the kernels' build (models/kernels/native.py imports it): the stack step of
// block_step.cpp as a plain function. A torch op's call from Python checks every argument for
// __torch_function__ and converts each list element into the dispatcher's values, which cost a small
// translator's step more than its embedding and attention together; bound directly, the arguments
// convert once and the step runs without the GIL (the replica's event loop goes on while a step
// computes, as it did during an op's call).

#include <torch/csrc/utils/pybind.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<ts::Blocks, std::shared_ptr<ts::Blocks>>(m, "Blocks")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<c10::optional<at::Tensor>>, double, bool, bool,
                          std::vector<at::Tensor>, std::vector<c10::optional<at::Tensor>>, std::vector<int64_t>,
                          std::vector<int64_t>, std::vector<int64_t>, int64_t, bool, int64_t, int64_t, double,
                          int64_t, bool>())
      .def("set_lora", &ts::Blocks::set_lora);
  pybind11::class_<ts::StepArgs>(m, "StepArgs")
      .def(pybind11::init<>())
      .def_readwrite("x", &ts::StepArgs::x)
      .def_readwrite("ids", &ts::StepArgs::ids)
      .def_readwrite("embed", &ts::StepArgs::embed)
      .def_readwrite("embed_scale", &ts::StepArgs::embed_scale)
      .def_readwrite("pos_table", &ts::StepArgs::pos_table)
      .def_readwrite("positions", &ts::StepArgs::positions)
      .def_readwrite("cos", &ts::StepArgs::cos)
      .def_readwrite("sin", &ts::StepArgs::sin)
      .def_readwrite("k_pools", &ts::StepArgs::k_pools)
      .def_readwrite("v_pools", &ts::StepArgs::v_pools)
      .def_readwrite("slots", &ts::StepArgs::slots)
      .def_readwrite("keys", &ts::StepArgs::keys)
      .def_readwrite("tables", &ts::StepArgs::tables)
      .def_readwrite("past", &ts::StepArgs::past)
      .def_readwrite("block", &ts::StepArgs::block)
      .def_readwrite("cross_k", &ts::StepArgs::cross_k)
      .def_readwrite("cross_v", &ts::StepArgs::cross_v)
      .def_readwrite("sources", &ts::StepArgs::sources)
      .def_readwrite("source_keys", &ts::StepArgs::source_keys)
      .def_readwrite("final_norm", &ts::StepArgs::final_norm)
      .def_readwrite("final_norm_bias", &ts::StepArgs::final_norm_bias)
      .def_readwrite("final_eps", &ts::StepArgs::final_eps)
      .def_readwrite("final_rms", &ts::StepArgs::final_rms)
      .def_readwrite("head", &ts::StepArgs::head)
      .def_readwrite("head_bias", &ts::StepArgs::head_bias)
      .def_readwrite("head_kind", &ts::StepArgs::head_kind)
      .def_readwrite("head_n", &ts::StepArgs::head_n)
      .def_readwrite("head_parts", &ts::StepArgs::head_parts)
      .def_readwrite("adapters", &ts::StepArgs::adapters);
  m.def("stack_step", &ts::stack_step, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "One step of a stack of blocks (block_step.cpp)");
  m.def("beam_top", &ts::beam_top, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "A beam search step's best candidates (select.cpp)");
  m.def("search_select", &ts::search_select, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "A search step's candidates from the decoder's logits (select.cpp)");
  m.def("copy_blocks", &ts::copy_blocks, pybind11::call_guard<pybind11::gil_scoped_release>(), "Blocks of a paged pool copied into others (pool.cpp)");
}
