/* Atomic access to ring memory from Python.
 *
 * The ring lives in memory shared with other processes and with the GPU. Python has no
 * atomics, so the few operations the ownership rules need are here: 32/64-bit
 * compare-and-swap, acquire loads, release stores and a full fence. Addresses are plain
 * integers (the mapping's base plus an offset) so that numpy views and mmap objects can be
 * used alike. On x86-64 acquire/release are plain moves; on weakly ordered CPUs (the DPU's
 * ARM cores) they compile to ldar/stlr, which is what the ordering table requires. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static int check_aligned(uintptr_t addr, uintptr_t align) {
  if (addr == 0 || (addr & (align - 1)) != 0) {
    PyErr_Format(PyExc_ValueError, "address 0x%zx is not %zu-byte aligned", (size_t)addr, (size_t)align);
    return 0;
  }
  return 1;
}

static PyObject *cas64(PyObject *self, PyObject *args) {
  unsigned long long addr, expected, desired;
  if (!PyArg_ParseTuple(args, "KKK", &addr, &expected, &desired)) return NULL;
  if (!check_aligned((uintptr_t)addr, 8)) return NULL;
  uint64_t exp = expected;
  __atomic_compare_exchange_n((uint64_t *)(uintptr_t)addr, &exp, (uint64_t)desired, 0, __ATOMIC_ACQ_REL,
                              __ATOMIC_ACQUIRE);
  return PyLong_FromUnsignedLongLong(exp); /* the value seen: equals expected on success */
}

static PyObject *cas32(PyObject *self, PyObject *args) {
  unsigned long long addr;
  unsigned int expected, desired;
  if (!PyArg_ParseTuple(args, "KII", &addr, &expected, &desired)) return NULL;
  if (!check_aligned((uintptr_t)addr, 4)) return NULL;
  uint32_t exp = expected;
  __atomic_compare_exchange_n((uint32_t *)(uintptr_t)addr, &exp, (uint32_t)desired, 0, __ATOMIC_ACQ_REL,
                              __ATOMIC_ACQUIRE);
  return PyLong_FromUnsignedLong(exp);
}

static PyObject *fetch_add64(PyObject *self, PyObject *args) {
  unsigned long long addr, delta;
  if (!PyArg_ParseTuple(args, "KK", &addr, &delta)) return NULL;
  if (!check_aligned((uintptr_t)addr, 8)) return NULL;
  return PyLong_FromUnsignedLongLong(__atomic_fetch_add((uint64_t *)(uintptr_t)addr, delta, __ATOMIC_ACQ_REL));
}

static PyObject *fetch_xor64(PyObject *self, PyObject *args) {
  unsigned long long addr, bits;
  if (!PyArg_ParseTuple(args, "KK", &addr, &bits)) return NULL;
  if (!check_aligned((uintptr_t)addr, 8)) return NULL;
  return PyLong_FromUnsignedLongLong(__atomic_fetch_xor((uint64_t *)(uintptr_t)addr, bits, __ATOMIC_ACQ_REL));
}

static PyObject *load_acquire32(PyObject *self, PyObject *args) {
  unsigned long long addr;
  if (!PyArg_ParseTuple(args, "K", &addr)) return NULL;
  if (!check_aligned((uintptr_t)addr, 4)) return NULL;
  return PyLong_FromUnsignedLong(__atomic_load_n((uint32_t *)(uintptr_t)addr, __ATOMIC_ACQUIRE));
}

static PyObject *load_acquire64(PyObject *self, PyObject *args) {
  unsigned long long addr;
  if (!PyArg_ParseTuple(args, "K", &addr)) return NULL;
  if (!check_aligned((uintptr_t)addr, 8)) return NULL;
  return PyLong_FromUnsignedLongLong(__atomic_load_n((uint64_t *)(uintptr_t)addr, __ATOMIC_ACQUIRE));
}

static PyObject *store_release32(PyObject *self, PyObject *args) {
  unsigned long long addr;
  unsigned int value;
  if (!PyArg_ParseTuple(args, "KI", &addr, &value)) return NULL;
  if (!check_aligned((uintptr_t)addr, 4)) return NULL;
  __atomic_store_n((uint32_t *)(uintptr_t)addr, (uint32_t)value, __ATOMIC_RELEASE);
  Py_RETURN_NONE;
}

static PyObject *store_release64(PyObject *self, PyObject *args) {
  unsigned long long addr, value;
  if (!PyArg_ParseTuple(args, "KK", &addr, &value)) return NULL;
  if (!check_aligned((uintptr_t)addr, 8)) return NULL;
  __atomic_store_n((uint64_t *)(uintptr_t)addr, (uint64_t)value, __ATOMIC_RELEASE);
  Py_RETURN_NONE;
}

static PyObject *fence(PyObject *self, PyObject *noargs) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"cas64", cas64, METH_VARARGS, "cas64(addr, expected, desired) -> value seen (== expected on success)"},
    {"cas32", cas32, METH_VARARGS, "cas32(addr, expected, desired) -> value seen (== expected on success)"},
    {"fetch_add64", fetch_add64, METH_VARARGS, "fetch_add64(addr, delta) -> previous value"},
    {"fetch_xor64", fetch_xor64, METH_VARARGS, "fetch_xor64(addr, bits) -> previous value"},
    {"load_acquire32", load_acquire32, METH_VARARGS, "acquire load of a 32-bit word"},
    {"load_acquire64", load_acquire64, METH_VARARGS, "acquire load of a 64-bit word"},
    {"store_release32", store_release32, METH_VARARGS, "release store of a 32-bit word"},
    {"store_release64", store_release64, METH_VARARGS, "release store of a 64-bit word"},
    {"fence", fence, METH_NOARGS, "full (sequentially consistent) fence"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "shared._atomics", "ring atomics", -1, methods};

PyMODINIT_FUNC PyInit__atomics(void) { return PyModule_Create(&module); }
