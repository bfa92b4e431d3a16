/*
 * The per-tensor reads of a put in C++: the optional compiled helper of
 * ray_rdt_pool.memory.describe, built against the installed torch by
 * `python -m ray_rdt_pool.memory.native build` (the package works without it).
 *
 * Why: describe() reads seven facts off every tensor of an object (dtype, size, rank,
 * address, device, contiguity, negation bit). From Python each read is one attribute
 * lookup or method call through torch's bindings, which for objects of thousands of small
 * tensors adds up to milliseconds per put. Here the same facts come straight off each
 * tensor's TensorImpl.
 *
 * What it promises: describe() returns exactly what the Python loop of
 * ray_rdt_pool.memory.describe returns for the same tensors, or None. It answers None, and
 * the Python loop runs instead (and raises the typed error where one is due), for anything
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

// The facts every call needs besides the tensors, bound once by init() (owned refs).
struct Tables {
  std::vector<PyObject*> names;   // ScalarType index -> wire name, or null
  std::vector<PyObject*> aligns;  // ScalarType index -> element size as a Python int
  std::vector<PyObject*> types;   // the exact tensor types accepted
  uintptr_t min_addr = 0;
  bool ready = false;

  void clear() {
    for (auto* v : {&names, &aligns, &types}) {
      for (PyObject* o : *v) Py_XDECREF(o);
      v->clear();
    }
    ready = false;
  }
};

Tables g_tables;

// The Python objects made for the keys seen last in one call, so an object's equal
// shapes share one tuple (they then compare by identity, and the object holds few
// tuples, as with the Python loop) and its handful of byte counts share one int each.
template <typename Key>
class Recent {
 public:
  ~Recent() {
    for (auto& e : entries_) Py_DECREF(e.second);
  }
  // A new reference to the object kept for a key equal to k, or null.
  template <typename K>
  PyObject* find(const K& k) const {
    for (auto& e : entries_) {
      if (same(e.first, k)) {
        Py_INCREF(e.second);
        return e.second;
      }
    }
    return nullptr;
  }
  // Keeps obj (a new reference, or null) for key; returns it as a new reference.
  PyObject* keep(Key key, PyObject* obj) {
    if (!obj) return nullptr;
    Py_INCREF(obj);
    if (entries_.size() < kSlots) {
      entries_.emplace_back(std::move(key), obj);
    } else {
      Py_DECREF(entries_[next_].second);
      entries_[next_] = {std::move(key), obj};
      next_ = (next_ + 1) % kSlots;
    }
    return obj;
  }

 private:
  static bool same(int64_t a, int64_t b) { return a == b; }
  static bool same(const std::vector<int64_t>& a, c10::IntArrayRef b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
  }
  static constexpr size_t kSlots = 16;
  std::vector<std::pair<Key, PyObject*>> entries_;
  size_t next_ = 0;
};

// A new tuple of Python ints for sizes, or null with a Python error set.
PyObject* shape_tuple(c10::IntArrayRef sizes) {
  PyObject* tup = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
  for (size_t i = 0; tup && i < sizes.size(); i++) {
    PyObject* v = PyLong_FromLongLong(sizes[i]);
    if (!v) {
      Py_CLEAR(tup);
      break;
    }
    PyTuple_SET_ITEM(tup, static_cast<Py_ssize_t>(i), v);
  }
  return tup;
}

bool accepted_type(PyObject* o) {
  auto* tp = reinterpret_cast<PyObject*>(Py_TYPE(o));
  for (PyObject* ok : g_tables.types) {
    if (tp == ok) return true;
  }
  return false;
}

// Reads one tensor. Returns false (no Python error) where the Python loop must decide.
bool read_one(const at::Tensor& t, int64_t& dtype, int64_t& nbytes, uintptr_t& ptr,
              bool& plain) {
  const Tables& tb = g_tables;
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
  // A storage resized under the view (FSDP frees flat parameters so) leaves an address
  // that is only an offset, or a view reaching past the storage: the Python loop names it.
  if (nbytes > 0) {
    if (!impl->has_storage()) return false;
    const c10::Storage& st = impl->storage();
    auto base = reinterpret_cast<uintptr_t>(st.data());
    if (!base || ptr < base) return false;
    uint64_t last = 0;
    auto sizes = t.sizes();
    auto strides = t.strides();
    for (size_t d = 0; d < sizes.size(); d++) {
      last += static_cast<uint64_t>(sizes[d] - 1) * static_cast<uint64_t>(strides[d]);
    }
    uint64_t extent = (last + 1) * static_cast<uint64_t>(t.element_size());
    if (ptr - base + extent > static_cast<uint64_t>(st.nbytes())) return false;
  }
  plain = t.is_contiguous() && !t.is_neg() && !t.is_conj();
  return true;
}

// init(names, aligns, types, min_addr): bind the tables every describe() uses.
PyObject* init(PyObject*, PyObject* args) {
  PyObject *names, *aligns, *types;
  unsigned long long min_addr;
  if (!PyArg_ParseTuple(args, "O!O!O!K", &PyList_Type, &names, &PyList_Type, &aligns,
                        &PyTuple_Type, &types, &min_addr)) {
    return nullptr;
  }
  Py_ssize_t n = PyList_GET_SIZE(names);
  if (PyList_GET_SIZE(aligns) != n) {
    PyErr_SetString(PyExc_ValueError, "init(): names and aligns differ in length");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); i++) {
    if (!PyType_Check(PyTuple_GET_ITEM(types, i))) {
      PyErr_SetString(PyExc_TypeError, "init(): types must be a tuple of types");
      return nullptr;
    }
  }
  g_tables.clear();
  g_tables.names.assign(static_cast<size_t>(n), nullptr);
  g_tables.aligns.assign(static_cast<size_t>(n), nullptr);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* nm = PyList_GET_ITEM(names, i);
    if (nm != Py_None) {
      PyObject* al = PyList_GET_ITEM(aligns, i);
      Py_INCREF(nm);
      Py_INCREF(al);
      g_tables.names[i] = nm;
      g_tables.aligns[i] = al;
    }
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); i++) {
    PyObject* tp = PyTuple_GET_ITEM(types, i);
    Py_INCREF(tp);
    g_tables.types.push_back(tp);
  }
  g_tables.min_addr = static_cast<uintptr_t>(min_addr);
  g_tables.ready = true;
  Py_RETURN_NONE;
}

// describe(tensors) -> (shapes, dtypes, nbytes, aligns, ptrs, plain) or None
PyObject* describe(PyObject*, PyObject* seq_in) {
  if (!g_tables.ready) {
    PyErr_SetString(PyExc_RuntimeError, "describe() before init()");
    return nullptr;
  }
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
    Recent<std::vector<int64_t>> shapes;
    Recent<int64_t> sizes;
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject* o = items[i];
      if (!accepted_type(o)) {
        fallback = true;
        break;
      }
      const at::Tensor& t = THPVariable_Unpack(o);
      int64_t dtype = 0, nbytes = 0;
      uintptr_t ptr = 0;
      bool plain = false;
      if (!read_one(t, dtype, nbytes, ptr, plain)) {
        fallback = true;
        break;
      }
      c10::IntArrayRef dims = t.sizes();
      PyObject* shape = shapes.find(dims);
      if (!shape) {
        shape = shapes.keep(std::vector<int64_t>(dims.begin(), dims.end()), shape_tuple(dims));
      }
      PyObject* nb = shape ? sizes.find(nbytes) : nullptr;
      if (shape && !nb) nb = sizes.keep(nbytes, PyLong_FromLongLong(nbytes));
      PyObject* p = nb ? PyLong_FromUnsignedLongLong(ptr) : nullptr;
      if (!p) {
        Py_XDECREF(shape);
        Py_XDECREF(nb);
        goto fail;
      }
      PyObject* name = g_tables.names[dtype];
      PyObject* align = g_tables.aligns[dtype];
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
    {"init", init, METH_VARARGS,
     "init(names, aligns, types, min_addr): bind the dtype tables (ScalarType index -> "
     "wire name and element size), the exact tensor types accepted and the no-memory "
     "bound that every describe() uses."},
    {"describe", describe, METH_O,
     "describe(tensors): the facts of memory.describe, or None where the Python loop "
     "must decide."},
    {"scalar_types", scalar_types, METH_O,
     "scalar_types(dtypes): the ScalarType index of each torch.dtype."},
    {"built_for", built_for, METH_NOARGS, "The torch build this helper was compiled for."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&kModule); }
