package usage

import (
	"errors"
	"os"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// TestRealNVML samples the processes of a machine's real GPUs twice (the
// second pass reads only samples newer than the first) and resolves their
// PIDs from /proc; it changes nothing. Run it with GPU_AGENT_REAL_NVML=1,
// with a CUDA program running to see processes.
func TestRealNVML(t *testing.T) {
	if os.Getenv("GPU_AGENT_REAL_NVML") != "1" {
		t.Skip("set GPU_AGENT_REAL_NVML=1 on a machine with an NVIDIA GPU")
	}
	lib := nvml.New()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		t.Fatalf("nvml Init: %v", ret)
	}
	defer lib.Shutdown()
	inv, err := gpu.New(lib, gpu.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s, r := NewSampler(lib), NewResolver("/proc")
	for pass := range 2 {
		samples, err := s.Sample(inv)
		if err != nil {
			t.Errorf("pass %d: %v", pass, err)
		}
		for _, ps := range samples {
			o, err := r.Resolve(ps.PID)
			if err != nil && !errors.Is(err, ErrGone) {
				t.Errorf("pid %d: %v", ps.PID, err)
			}
			t.Logf("pass %d: %+v owner %+v", pass, ps, o)
		}
	}
}
