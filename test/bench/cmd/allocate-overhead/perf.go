package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// startPerf runs `perf record -g` on each agent's process and on the bare
// plugin's (pid 0: served in this process, not recorded) until the
// returned func is called, each into dir/LABEL.data. perf's own CPU falls
// on both sides alike. Read one with
//
//	perf report -i DIR/LABEL.data --no-children --sort symbol
func startPerf(dir string, agents []*agentProc, barePID int) (stop func(), err error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var cmds []*exec.Cmd
	stopAll := func() {
		for _, c := range cmds {
			// SIGINT: perf writes its file out and exits.
			_ = c.Process.Signal(os.Interrupt)
		}
		for _, c := range cmds {
			done := make(chan struct{})
			go func() { _ = c.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				_ = c.Process.Kill()
				<-done
			}
		}
	}
	targets := map[string]int{}
	for _, a := range agents {
		targets[a.label] = a.cmd.Process.Pid
	}
	if barePID != 0 {
		targets["bare"] = barePID
	}
	for label, pid := range targets {
		out := filepath.Join(dir, fileLabel(label)+".data")
		c := exec.Command("perf", "record", "-F", "1999", "-g", "-p", strconv.Itoa(pid), "-o", out)
		c.Stderr = os.Stderr
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGINT}
		if err := c.Start(); err != nil {
			stopAll()
			if errors.Is(err, exec.ErrNotFound) {
				return nil, errors.New("perf is not installed")
			}
			return nil, fmt.Errorf("perf record of %s: %w", label, err)
		}
		cmds = append(cmds, c)
	}
	var once sync.Once
	return func() { once.Do(stopAll) }, nil
}

// fileLabel is a label as a file name: "control (bare)" → "control-bare".
func fileLabel(label string) string {
	f := strings.FieldsFunc(label, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-')
	})
	return strings.Join(f, "-")
}
