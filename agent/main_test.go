package agent

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/gpu-agent/gpu-agent/mps/simdaemon"
)

// mpsControlSim is the argument that makes this test binary the product's
// stand-in MPS control program (mps/simdaemon), as gpu-agent runs itself
// on simulated nodes (gpu-agent mps-control-sim).
const mpsControlSim = "mps-control-sim"

func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == mpsControlSim {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
		err := simdaemon.Main(ctx, []string{os.Args[0], mpsControlSim}, os.Args[2:], os.Getenv, os.Stdin, os.Stdout)
		stop()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// mpsStandIn is the MPS control program the agent's tests run: this test
// binary as the stand-in, and its arguments.
func mpsStandIn(t *testing.T) (binary string, args []string) {
	t.Helper()
	self, err := os.Executable()
	if err == nil {
		self, err = filepath.EvalSymlinks(self)
	}
	if err != nil {
		t.Fatal(err)
	}
	return self, []string{mpsControlSim}
}
