// Argument checks of adam_step (adam_cpu.cpp includes this inside its anonymous namespace,
// after torch/extension.h): every tensor 1-D, contiguous, on the CPU, of the expected dtype and
// length, each failure a ValueError naming the list and index.
#pragma once

// Numbers in error messages are made strings here (std::to_string, snprintf), never streamed: on
// the GPU host (torch 2.11.0+cu130, the system g++) a message that streamed an integer into
// c10::str's ostream crashed the process (SIGSEGV) where it should have raised ValueError
// (tests/test_kernels.py::test_bad_input_is_refused_before_writing; strings and dtypes streamed fine).
std::string N(int64_t x) { return std::to_string(x); }
std::string N(size_t x) { return std::to_string(x); }
std::string D(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}
std::string dims(at::IntArrayRef a) {
  std::string s = "[";
  for (size_t k = 0; k < a.size(); ++k) s += (k ? ", " : "") + std::to_string(a[k]);
  return s + "]";
}

std::string where(const char* list, size_t i) { return std::string(list) + "[" + std::to_string(i) + "]"; }

void check_1d(const at::Tensor& t, const char* list, size_t i, int64_t n, std::vector<at::ScalarType> ok,
              const char* dtypes) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "adam_step: ", where(list, i), " is on ", t.device().str(),
                    "; every tensor must be a CPU tensor");
  TORCH_CHECK_VALUE(t.dim() == 1, "adam_step: ", where(list, i), " has shape ", dims(t.sizes()),
                    "; every tensor must be 1-D");
  TORCH_CHECK_VALUE(t.is_contiguous(), "adam_step: ", where(list, i), " is not contiguous (stride ",
                    dims(t.strides()), ")");
  TORCH_CHECK_VALUE(std::find(ok.begin(), ok.end(), t.scalar_type()) != ok.end(), "adam_step: ",
                    where(list, i), " has dtype ", t.scalar_type(), "; expected ", dtypes);
  TORCH_CHECK_VALUE(t.numel() == n, "adam_step: ", where(list, i), " has ", N(t.numel()),
                    " elements; expected ", N(n));
}
