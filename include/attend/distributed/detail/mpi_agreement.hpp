// SPDX-License-Identifier: MIT
#pragma once
/// Errors that every rank of a communicator throws alike. A check that fails on one rank only (its own shapes,
/// a non-finite value in its shard) must not leave the other ranks waiting in a send or a collective that rank
/// never reaches: each rank captures its first error, the ranks agree on the lowest failing rank with one
/// collective, and that rank's error (kind, id, message) is broadcast and thrown everywhere.

#include <cstdint>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include <mpi.h>

#include "../../error.hpp"

namespace attend::distributed::detail {

/// Which class of attend::error to rebuild on the ranks that did not throw it.
enum class error_kind : int { shape, mask, value, position, resource, format };

/// An error one rank caught, in a form that crosses the network.
struct captured_error {
    error_kind kind = error_kind::format;
    std::string id;
    std::string message;  ///< what() without the id
};

inline captured_error capture(const attend::error& e) {
    captured_error c;
    if (dynamic_cast<const shape_error*>(&e)) c.kind = error_kind::shape;
    else if (dynamic_cast<const mask_error*>(&e)) c.kind = error_kind::mask;
    else if (dynamic_cast<const value_error*>(&e)) c.kind = error_kind::value;
    else if (dynamic_cast<const position_error*>(&e)) c.kind = error_kind::position;
    else if (dynamic_cast<const resource_error*>(&e)) c.kind = error_kind::resource;
    else c.kind = error_kind::format;
    c.id = e.id();
    c.message = e.message();
    return c;
}

/// Runs f and returns the attend::error it throws, if any (std::bad_alloc becomes attend.resource.allocation),
/// so a rank can keep its place in the communication schedule and report the error at the next agreement.
template <class F>
std::optional<captured_error> capture_errors(F&& f) {
    try {
        f();
    } catch (const attend::error& e) {
        return capture(e);
    } catch (const std::bad_alloc&) {
        return captured_error{error_kind::resource, "attend.resource.allocation",
                              "a ring attention buffer could not be allocated"};
    }
    return std::nullopt;
}

[[noreturn]] inline void throw_captured(const captured_error& c) {
    switch (c.kind) {
        case error_kind::shape: throw shape_error(c.id, c.message);
        case error_kind::mask: throw mask_error(c.id, c.message);
        case error_kind::value: throw value_error(c.id, c.message);
        case error_kind::position: throw position_error(c.id, c.message);
        case error_kind::resource: throw resource_error(c.id, c.message);
        case error_kind::format: break;
    }
    throw format_error(c.id, c.message);
}

/// Broadcasts `root`'s error to every rank and throws it there, with "(rank <root> of <size>)" appended so the
/// message says where it happened and is the same text on every rank. Collective.
[[noreturn]] inline void throw_from(MPI_Comm comm, int root, const std::optional<captured_error>& mine) {
    int rank = 0, size = 0;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    std::int64_t header[3] = {0, 0, 0};
    if (rank == root) {
        header[0] = static_cast<std::int64_t>(mine->kind);
        header[1] = static_cast<std::int64_t>(mine->id.size());
        header[2] = static_cast<std::int64_t>(mine->message.size());
    }
    MPI_Bcast(header, 3, MPI_INT64_T, root, comm);
    std::string text(static_cast<std::size_t>(header[1] + header[2]), '\0');
    if (rank == root) text = mine->id + mine->message;
    MPI_Bcast(text.data(), static_cast<int>(text.size()), MPI_CHAR, root, comm);
    captured_error c;
    c.kind = static_cast<error_kind>(header[0]);
    c.id = text.substr(0, static_cast<std::size_t>(header[1]));
    c.message =
        attend::detail::concat(text.substr(static_cast<std::size_t>(header[1])), " (rank ", root, " of ", size, ')');
    throw_captured(c);
}

/// Collective: returns when no rank has an error; otherwise every rank throws the error of the lowest rank that
/// has one.
inline void agree_on_errors(MPI_Comm comm, const std::optional<captured_error>& mine) {
    int rank = 0, size = 0;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    int mine_rank = mine ? rank : size, lowest = size;
    MPI_Allreduce(&mine_rank, &lowest, 1, MPI_INT, MPI_MIN, comm);
    if (lowest < size) throw_from(comm, lowest, mine);
}

}  // namespace attend::distributed::detail
