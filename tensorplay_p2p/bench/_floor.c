/* The benchmark's floor: the MPI calls the package makes, in a C loop, so that a table can show what MPI itself
 * costs.  Built at run time with the MPI library's own mpicc (bench/_floor.py), called through ctypes; each function
 * runs ``n`` iterations and returns their wall time in seconds.  A communicator arrives as its Fortran handle
 * (mpi4py's ``Comm.py2f()``). */
#include <mpi.h>
#include <stdlib.h>

/* The MPI library this was built against, as MPI_Get_library_version words it (checked against mpi4py's). */
int
floor_library(char *text)
{
    int length = 0;
    MPI_Get_library_version(text, &length);
    return length;
}

/* One exchange with ``peer``: Irecv, Isend, one Waitall (the package's batch_isend_irecv of two ops). */
double
floor_exchange(MPI_Fint handle, void *out, void *into, int nbytes, int peer, int tag, int n)
{
    MPI_Comm comm = MPI_Comm_f2c(handle);
    MPI_Request requests[2];
    double start = MPI_Wtime();
    for (int i = 0; i < n; i++) {
        MPI_Irecv(into, nbytes, MPI_BYTE, peer, tag, comm, &requests[0]);
        MPI_Isend(out, nbytes, MPI_BYTE, peer, tag, comm, &requests[1]);
        MPI_Waitall(2, requests, MPI_STATUSES_IGNORE);
    }
    return MPI_Wtime() - start;
}

/* A blocking ping-pong (osu_latency): Send then Recv on the leader, Recv then Send on the other. */
double
floor_latency(MPI_Fint handle, void *out, void *into, int nbytes, int peer, int tag, int leader, int n)
{
    MPI_Comm comm = MPI_Comm_f2c(handle);
    double start = MPI_Wtime();
    for (int i = 0; i < n; i++) {
        if (leader) {
            MPI_Send(out, nbytes, MPI_BYTE, peer, tag, comm);
            MPI_Recv(into, nbytes, MPI_BYTE, peer, tag, comm, MPI_STATUS_IGNORE);
        } else {
            MPI_Recv(into, nbytes, MPI_BYTE, peer, tag, comm, MPI_STATUS_IGNORE);
            MPI_Send(out, nbytes, MPI_BYTE, peer, tag, comm);
        }
    }
    return MPI_Wtime() - start;
}

/* One collective of ``count`` float32 per rank's block, the nonblocking call the package posts, then MPI_Wait:
 * 0 all_reduce (in place), 1 broadcast (from rank 0, as bytes), 2 all_gather_into_tensor (bytes),
 * 3 reduce_scatter_tensor, 4 all_to_all_single (MPI_Ialltoallv of bytes, even counts), 5 all_gather
 * (MPI_Iallgatherv of bytes), 6 gather and 7 scatter (MPI_Igatherv, MPI_Iscatterv of bytes, rooted at rank 0). */
double
floor_collective(int which, MPI_Fint handle, void *source, void *into, int count, int n)
{
    MPI_Comm comm = MPI_Comm_f2c(handle);
    int size = 1;
    MPI_Comm_size(comm, &size);
    int *counts = malloc(sizeof(int) * (size_t)size), *displs = malloc(sizeof(int) * (size_t)size);
    if (counts == NULL || displs == NULL) {
        free(counts);
        free(displs);
        return -1.0;
    }
    int nbytes = count * (int)sizeof(float);
    for (int r = 0; r < size; r++)
        counts[r] = nbytes, displs[r] = r * nbytes;
    MPI_Request request;
    double start = MPI_Wtime();
    for (int i = 0; i < n; i++) {
        switch (which) {
        case 0:
            MPI_Iallreduce(MPI_IN_PLACE, into, count, MPI_FLOAT, MPI_SUM, comm, &request);
            break;
        case 1:
            MPI_Ibcast(into, nbytes, MPI_BYTE, 0, comm, &request);
            break;
        case 2:
            MPI_Iallgather(source, nbytes, MPI_BYTE, into, nbytes, MPI_BYTE, comm, &request);
            break;
        case 3:
            MPI_Ireduce_scatter_block(source, into, count, MPI_FLOAT, MPI_SUM, comm, &request);
            break;
        case 4:
            MPI_Ialltoallv(source, counts, displs, MPI_BYTE, into, counts, displs, MPI_BYTE, comm, &request);
            break;
        case 5:
            MPI_Iallgatherv(source, nbytes, MPI_BYTE, into, counts, displs, MPI_BYTE, comm, &request);
            break;
        case 6:
            MPI_Igatherv(source, nbytes, MPI_BYTE, into, counts, displs, MPI_BYTE, 0, comm, &request);
            break;
        default:
            MPI_Iscatterv(source, counts, displs, MPI_BYTE, into, nbytes, MPI_BYTE, 0, comm, &request);
        }
        MPI_Wait(&request, MPI_STATUS_IGNORE);
    }
    double elapsed = MPI_Wtime() - start;
    free(counts);
    free(displs);
    return elapsed;
}
