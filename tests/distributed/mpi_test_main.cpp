// SPDX-License-Identifier: MIT
// main() of the MPI tests: every rank runs every test (the tests are collective), rank 0 prints the usual
// report and the other ranks print only their failures, tagged with the rank. mpirun fails when any rank does.

#include <cstdio>

#include <gtest/gtest.h>
#include <mpi.h>

namespace {

/// Failures of a rank other than 0, one line each, so they are not lost behind rank 0's report.
class rank_failure_printer : public ::testing::EmptyTestEventListener {
public:
    explicit rank_failure_printer(int rank) : rank_(rank) {}
    void OnTestPartResult(const ::testing::TestPartResult& result) override {
        if (!result.failed()) return;
        std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, result.file_name() ? result.file_name() : "?",
                     result.line_number(), result.summary());
    }

private:
    int rank_;
};

}  // namespace

int main(int argc, char** argv) {
    int provided = 0;  // the ring computes on a worker thread while this one calls MPI
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    ::testing::InitGoogleTest(&argc, argv);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank != 0) {
        auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
        delete listeners.Release(listeners.default_result_printer());
        listeners.Append(new rank_failure_printer(rank));
    }
    const int failed = RUN_ALL_TESTS();
    MPI_Finalize();
    return failed;
}
