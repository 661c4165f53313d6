// An output buffer for the drivers' kernel calls with guard bytes on either side: check() throws, naming the
// call, when a kernel wrote before or past its output.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

template <typename T>
class Guarded {
 public:
  static constexpr int64_t kGuard = 256;  // elements on each side

  Guarded(int64_t n, T fill, T guard) : buf_(n + 2 * kGuard, fill), n_(n), guard_(guard) {
    for (int64_t i = 0; i < kGuard; ++i) buf_[i] = buf_[kGuard + n + i] = guard;
  }
  T* data() { return buf_.data() + kGuard; }
  const T* data() const { return buf_.data() + kGuard; }
  T& operator[](int64_t i) { return data()[i]; }
  const T& operator[](int64_t i) const { return data()[i]; }
  int64_t size() const { return n_; }
  std::vector<T> values() const { return std::vector<T>(data(), data() + n_); }

  void check(const std::string& what) const {
    for (int64_t i = 0; i < kGuard; ++i) {
      if (!same(buf_[i])) throw std::runtime_error(what + " wrote " + std::to_string(kGuard - i) + " element(s) before its output");
      if (!same(buf_[kGuard + n_ + i]))
        throw std::runtime_error(what + " wrote past its output (element " + std::to_string(n_ + i) + " of " +
                                 std::to_string(n_) + ")");
    }
  }

 private:
  bool same(const T& v) const { return std::memcmp(&v, &guard_, sizeof(T)) == 0; }
  std::vector<T> buf_;
  int64_t n_;
  T guard_;
};
