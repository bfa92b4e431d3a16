/*
 * The per-tensor reads of a put in C++: the optional compiled helper of
 * ray_rdt_pool.native, built against the installed torch by
 * `python -m ray_rdt_pool.native build` (the package works without it).
 *
 * Why: tensors.describe reads seven facts off every tensor of an object (dtype, size,
 * rank, address, device, contiguity, negation bit). From Python each read is one
 * attribute lookup or method call through torch's bindings, 300 to 500 ns apiece, so a
 * put of 5,120 small tensors spent 6 to 12 ms there. Here the same facts come straight
 * off each tensor's TensorImpl.
 *
 * What it promises: describe() returns exactly what the Python loop of
 * tensors.describe returns for the same tensors, or None. It answers None, and the
 * Python loop runs instead (and raises the typed error where one is due), for anything
 * that is not a plain dense CPU tensor it can read without running Python code: a
 * subclass other than the exact types it was given, a layout other than strided, a
 * nested, sparse or meta tensor, a tensor with Python dispatch or symbolic sizes, a
 * dtype outside the table, an address below the no-memory bound, or any C++ exception.
 *
 * Threads: runs on its caller's thread with the GIL held (it builds Python lists); it
 * calls no Python code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace {

// The facts one call needs besides the tensors, handed in by the Python side.
struct Tables {
  std::vector<PyObject*> names;   // ScalarType index -> wire name (borrowed), or null
  std::vector<PyObject*> aligns;  // ScalarType index -> element size as a Python int
  std::vector<PyTypeObject*> types;  // the exact tensor types accepted
  uintptr_t min_addr = 0;
};

// One shape tuple per distinct size list among the last few seen, so the equal shapes
// of an object compare by identity and the object holds few tuples (as the Python loop).
class ShapeCache {
 public:
  ~ShapeCache() {
    for (auto& e : entries_) Py_XDECREF(e.tuple);
  }
  // A new reference to the tuple for these sizes, or null with a Python error set.
  PyObject* get(c10::IntArrayRef sizes) {
    for (auto& e : entries_) {
      if (e.sizes.size() == sizes.size() &&
          std::equal(e.sizes.begin(), e.sizes.end(), sizes.begin())) {
        Py_INCREF(e.tuple);
        return e.tuple;
      }
    }
    PyObject* tup = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
    if (!tup) return nullptr;
    for (size_t i = 0; i < sizes.size(); i++) {
      PyObject* v = PyLong_FromLongLong(sizes[i]);
      if (!v) {
        Py_DECREF(tup);
        return nullptr;
      }
      PyTuple_SET_ITEM(tup, static_cast<Py_ssize_t>(i), v);
    }
    Entry e{std::vector<int64_t>(sizes.begin(), sizes.end()), tup};
    Py_INCREF(tup);
    if (entries_.size() < kSlots) {
      entries_.push_back(std::move(e));
    } else {
      Py_DECREF(entries_[next_].tuple);
      entries_[next_] = std::move(e);
      next_ = (next_ + 1) % kSlots;
    }
    return tup;
  }

 private:
  static constexpr size_t kSlots = 16;
  struct Entry {
    std::vector<int64_t> sizes;
    PyObject* tuple;
  };
  std::vector<Entry> entries_;
  size_t next_ = 0;
};

// One Python int per distinct byte count among the last few seen: an object's tensors
// share a handful of sizes, and a new int each would cost an allocation per tensor.
class IntCache {
 public:
  ~IntCache() {
    for (auto& e : entries_) Py_XDECREF(e.second);
  }
  // A new reference to the int for v, or null with a Python error set.
  PyObject* get(int64_t v) {
    for (auto& e : entries_) {
      if (e.first == v) {
        Py_INCREF(e.second);
        return e.second;
      }
    }
    PyObject* o = PyLong_FromLongLong(v);
    if (!o) return nullptr;
    Py_INCREF(o);
    if (entries_.size() < kSlots) {
      entries_.emplace_back(v, o);
    } else {
      Py_DECREF(entries_[next_].second);
      entries_[next_] = {v, o};
      next_ = (next_ + 1) % kSlots;
    }
    return o;
  }

 private:
  static constexpr size_t kSlots = 16;
  std::vector<std::pair<int64_t, PyObject*>> entries_;
  size_t next_ = 0;
};

bool accepted_type(const Tables& tb, PyObject* o) {
  PyTypeObject* tp = Py_TYPE(o);
  for (PyTypeObject* ok : tb.types) {
    if (tp == ok) return true;
  }
  return false;
}

// Reads one tensor. Returns false (no Python error) where the Python loop must decide.
bool read_one(const Tables& tb, const at::Tensor& t, int64_t& dtype, int64_t& nbytes,
              uintptr_t& ptr, bool& plain) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->is_python_dispatch() || impl->has_symbolic_sizes_strides()) return false;
  if (t.layout() != c10::kStrided || impl->is_nested() || !t.is_cpu()) return false;
  if (t._is_zerotensor()) return false;
  dtype = static_cast<int64_t>(t.scalar_type());
  if (dtype < 0 || static_cast<size_t>(dtype) >= tb.names.size() || !tb.names[dtype]) {
    return false;
  }
  ptr = reinterpret_cast<uintptr_t>(t.data_ptr());
  if (ptr < tb.min_addr) return false;
  nbytes = static_cast<int64_t>(t.nbytes());
  plain = t.is_contiguous() && !t.is_neg() && !t.is_conj();
  return true;
}

PyObject* set_tables(Tables& tb, PyObject* names, PyObject* aligns, PyObject* types,
                     unsigned long long min_addr) {
  if (!PyList_Check(names) || !PyList_Check(aligns) || !PyTuple_Check(types) ||
      PyList_GET_SIZE(names) != PyList_GET_SIZE(aligns)) {
    PyErr_SetString(PyExc_TypeError, "describe(tensors, names, aligns, types, min_addr)");
    return nullptr;
  }
  Py_ssize_t n = PyList_GET_SIZE(names);
  tb.names.assign(static_cast<size_t>(n), nullptr);
  tb.aligns.assign(static_cast<size_t>(n), nullptr);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* nm = PyList_GET_ITEM(names, i);
    if (nm != Py_None) {
      tb.names[i] = nm;
      tb.aligns[i] = PyList_GET_ITEM(aligns, i);
    }
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); i++) {
    PyObject* tp = PyTuple_GET_ITEM(types, i);
    if (!PyType_Check(tp)) {
      PyErr_SetString(PyExc_TypeError, "types must be a tuple of types");
      return nullptr;
    }
    tb.types.push_back(reinterpret_cast<PyTypeObject*>(tp));
  }
  tb.min_addr = static_cast<uintptr_t>(min_addr);
  return Py_None;
}

// describe(tensors, names, aligns, types, min_addr)
//   -> (shapes, dtypes, nbytes, aligns, ptrs, plain) or None
PyObject* describe(PyObject*, PyObject* args) {
  PyObject *seq_in, *names, *aligns, *types;
  unsigned long long min_addr;
  if (!PyArg_ParseTuple(args, "OOOOK", &seq_in, &names, &aligns, &types, &min_addr)) {
    return nullptr;
  }
  Tables tb;
  if (!set_tables(tb, names, aligns, types, min_addr)) return nullptr;
  PyObject* seq = PySequence_Fast(seq_in, "describe() takes a sequence of tensors");
  if (!seq) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  PyObject* out[6] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  bool fallback = false;
  for (auto& l : out) {
    l = PyList_New(n);
    if (!l) goto fail;
  }
  try {
    ShapeCache shapes;
    IntCache sizes;
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject* o = items[i];
      if (!accepted_type(tb, o)) {
        fallback = true;
        break;
      }
      const at::Tensor& t = THPVariable_Unpack(o);
      int64_t dtype = 0, nbytes = 0;
      uintptr_t ptr = 0;
      bool plain = false;
      if (!read_one(tb, t, dtype, nbytes, ptr, plain)) {
        fallback = true;
        break;
      }
      PyObject* shape = shapes.get(t.sizes());
      PyObject* nb = shape ? sizes.get(nbytes) : nullptr;
      PyObject* p = nb ? PyLong_FromUnsignedLongLong(ptr) : nullptr;
      if (!p) {
        Py_XDECREF(shape);
        Py_XDECREF(nb);
        goto fail;
      }
      PyObject* name = tb.names[dtype];
      PyObject* align = tb.aligns[dtype];
      Py_INCREF(name);
      Py_INCREF(align);
      PyObject* pl = plain ? Py_True : Py_False;
      Py_INCREF(pl);
      PyList_SET_ITEM(out[0], i, shape);
      PyList_SET_ITEM(out[1], i, name);
      PyList_SET_ITEM(out[2], i, nb);
      PyList_SET_ITEM(out[3], i, align);
      PyList_SET_ITEM(out[4], i, p);
      PyList_SET_ITEM(out[5], i, pl);
    }
  } catch (...) {
    // A read torch refuses (no storage, an unusual TensorImpl): the Python loop decides.
    fallback = true;
  }
  Py_DECREF(seq);
  if (fallback) {
    for (auto& l : out) Py_DECREF(l);  // unset items are null, which list dealloc skips
    Py_RETURN_NONE;
  }
  return Py_BuildValue("(NNNNNN)", out[0], out[1], out[2], out[3], out[4], out[5]);
fail:
  Py_DECREF(seq);
  for (auto& l : out) Py_XDECREF(l);
  return nullptr;
}

// scalar_types(dtypes) -> the ScalarType index of each torch.dtype, for the tables.
PyObject* scalar_types(PyObject*, PyObject* arg) {
  PyObject* seq = PySequence_Fast(arg, "scalar_types() takes a sequence of torch.dtype");
  if (!seq) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject* out = PyList_New(n);
  for (Py_ssize_t i = 0; out && i < n; i++) {
    PyObject* d = PySequence_Fast_GET_ITEM(seq, i);
    if (!THPDtype_Check(d)) {
      PyErr_SetString(PyExc_TypeError, "scalar_types() takes torch.dtype objects only");
      Py_CLEAR(out);
      break;
    }
    PyObject* v = PyLong_FromLong(static_cast<long>(reinterpret_cast<THPDtype*>(d)->scalar_type));
    if (!v) {
      Py_CLEAR(out);
      break;
    }
    PyList_SET_ITEM(out, i, v);
  }
  Py_DECREF(seq);
  return out;
}

// The torch build this file was compiled against, so a loader can refuse a mismatch.
PyObject* built_for(PyObject*, PyObject*) {
  return PyUnicode_FromString(TORCH_BUILD_TAG);
}

PyMethodDef kMethods[] = {
    {"describe", describe, METH_VARARGS,
     "describe(tensors, names, aligns, types, min_addr): the facts of tensors.describe, "
     "or None where the Python loop must decide."},
    {"scalar_types", scalar_types, METH_O,
     "scalar_types(dtypes): the ScalarType index of each torch.dtype."},
    {"built_for", built_for, METH_NOARGS, "The torch build this helper was compiled for."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&kModule); }
