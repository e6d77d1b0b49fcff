package timeslice

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// DefaultSMI is the program Interval runs when Binary is empty.
const DefaultSMI = "nvidia-smi"

// Interval sets the compute time slice of whole GPUs the way NVIDIA's DRA
// driver does for its TimeSlicing config, through nvidia-smi (NVML offers
// no public call for it): the GPU's compute mode goes to DEFAULT, so that
// several processes may share it, then `compute-policy --set-timeslice`.
type Interval struct {
	// Binary is nvidia-smi, by path or found on PATH ("": DefaultSMI).
	Binary string
	// Timeout bounds each run (0: 10s); it runs on the agent's loop.
	Timeout time.Duration
}

// SetInterval sets GPU uuid's time slice to level (0 Default, 1 Short,
// 2 Medium, 3 Long).
func (t Interval) SetInterval(uuid string, level int) error {
	if level < 0 || level > 3 {
		return fmt.Errorf("gpu %s: time-slice level %d: must be 0..3", uuid, level)
	}
	if err := t.run("-i", uuid, "-c", "DEFAULT"); err != nil {
		return fmt.Errorf("gpu %s: compute mode DEFAULT: %w", uuid, err)
	}
	if err := t.run("compute-policy", "-i", uuid, "--set-timeslice", strconv.Itoa(level)); err != nil {
		return fmt.Errorf("gpu %s: time slice %d: %w", uuid, level, err)
	}
	return nil
}

func (t Interval) run(args ...string) error {
	bin, timeout := t.Binary, t.Timeout
	if bin == "" {
		bin = DefaultSMI
	}
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		if msg := strings.TrimSpace(out.String()); msg != "" {
			return fmt.Errorf("%s %s: %w: %.200s", bin, strings.Join(args, " "), err, msg)
		}
		return fmt.Errorf("%s %s: %w", bin, strings.Join(args, " "), err)
	}
	return nil
}
