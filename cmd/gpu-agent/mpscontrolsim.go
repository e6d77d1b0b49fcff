package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/gpu-agent/gpu-agent/mps/simdaemon"
)

// mpsControlSimCommand is the subcommand that stands in for
// nvidia-cuda-mps-control; the agent runs it as its MPS control program on
// simulated nodes (mps.Options.Args).
const mpsControlSimCommand = "mps-control-sim"

// cmdMPSControlSim runs `gpu-agent mps-control-sim`, the stand-in MPS
// control program of simulated nodes, with the real one's command line:
// `-d` starts the daemon in the background, no argument sends the lines of
// stdin to it and prints its answers. Both find the daemon through
// CUDA_MPS_PIPE_DIRECTORY, as the real program does.
func cmdMPSControlSim(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	if len(args) == 1 && (args[0] == "-h" || args[0] == "--help") {
		fmt.Fprintf(stdout, "Usage: gpu-agent %s [-d]\n\n"+
			"A stand-in for nvidia-cuda-mps-control on simulated nodes (no CUDA): -d starts the control daemon\n"+
			"of CUDA_MPS_PIPE_DIRECTORY (log in CUDA_MPS_LOG_DIRECTORY); without -d, each line of stdin is a\n"+
			"command to it (set_default_active_thread_percentage 25, get_default_device_pinned_mem_limit 0,\n"+
			"get_server_list, quit, ...). The agent runs it by itself with a sim: backend.\n", mpsControlSimCommand)
		return nil
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	err = simdaemon.Main(ctx, []string{self, mpsControlSimCommand}, args, os.Getenv, stdin, stdout)
	if u := (*simdaemon.UsageError)(nil); errors.As(err, &u) {
		return usageError{u.Error()}
	}
	return err
}
