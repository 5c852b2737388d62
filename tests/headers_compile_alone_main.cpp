// SPDX-License-Identifier: MIT
// The other translation units of headers_compile_alone each include one public header; building is the test.
int main() { return 0; }
