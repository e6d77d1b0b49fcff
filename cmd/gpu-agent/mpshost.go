package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/mps"
)

// cmdMPSHost runs `gpu-agent mps-host`: the MPS control daemons, in a
// process of their own. In Kubernetes a daemon dies with the container that
// started it; run by the agent, every agent upgrade would kill every MPS
// client. mps-host runs in its own DaemonSet, rarely upgraded, and learns
// which daemons to run from the desired.json the agent (`run --mps-host`)
// writes in the MPS root; it reports back in health.json there.
func cmdMPSHost(ctx context.Context, args []string, _, stderr io.Writer) error {
	fs := newFlagSet("mps-host", "mps-host [flags]", stderr)
	root := fs.String("mps-root", envDefault("GPU_AGENT_MPS_ROOT", "/run/gpu-agent/mps"),
		"root of the MPS pipe and log directories, shared with the agent (desired.json, health.json) [GPU_AGENT_MPS_ROOT]")
	binary := fs.String("mps-binary", envDefault("GPU_AGENT_MPS_BINARY", mps.DefaultBinary),
		"MPS control program, by path or found on PATH; "+mpsControlSimCommand+": gpu-agent's own stand-in, for simulated nodes [GPU_AGENT_MPS_BINARY]")
	logLevel := fs.String("log-level", envDefault("GPU_AGENT_LOG_LEVEL", "info"), "debug, info, warn or error [GPU_AGENT_LOG_LEVEL]")
	logFormat := fs.String("log-format", envDefault("GPU_AGENT_LOG_FORMAT", "text"), "text or json [GPU_AGENT_LOG_FORMAT]")
	interval, err := time.ParseDuration(envDefault("GPU_AGENT_MPS_INTERVAL", "5s"))
	if err != nil {
		return usageError{fmt.Sprintf("GPU_AGENT_MPS_INTERVAL: %v", err)}
	}
	fs.DurationVar(&interval, "interval", interval,
		"check every daemon and rewrite health.json this often; the agent counts mps-host gone after 3 intervals without a rewrite [GPU_AGENT_MPS_INTERVAL]")
	if err := parseNoArgs(fs, args); err != nil {
		return err
	}
	if interval <= 0 {
		return usageError{fmt.Sprintf("--interval %v: must be positive", interval)}
	}
	if *root == "" {
		return usageError{"--mps-root: must not be empty"}
	}
	log, err := newLogger(stderr, *logLevel, *logFormat)
	if err != nil {
		return usageError{err.Error()}
	}
	bin, binArgs, err := mpsProgram(*binary)
	if err != nil {
		return err
	}
	log.Info("gpu-agent mps-host starting", "mps-root", *root, "mps-binary", *binary, "interval", interval)
	err = mps.NewHost(mps.Options{Binary: bin, Args: binArgs, Root: *root, Logger: log, Interval: interval}).Run(ctx)
	if err == nil {
		log.Info("gpu-agent mps-host stopped")
	}
	return err
}

// mpsControl is what `gpu-agent run` needs of its MPS side: the loop's
// MPSControl, a signal when daemon health changes, and a Run that keeps it
// going. mps.Supervisor and mps.Remote both are one.
type mpsControl interface {
	agent.MPSControl
	Changes() <-chan struct{}
	Run(ctx context.Context) error
}

// newMPSControl is the agent's MPS side: with --mps-host, a Remote that asks
// mps-host for the daemons; otherwise a Supervisor that runs them in the
// agent's own container (where they die with it). A simulated node has no
// CUDA for nvidia-cuda-mps-control: unless --mps-binary names a program,
// its daemons are gpu-agent's own stand-in (`gpu-agent mps-control-sim`).
// The mps package names its component in the log itself.
func newMPSControl(f runFlags, simulated bool, log *slog.Logger) (mpsControl, error) {
	if f.mpsHost {
		log.Info("MPS daemons are run by gpu-agent mps-host; this agent asks for them in the MPS root", "mps-root", f.mpsRoot)
		return mps.NewRemote(mps.RemoteOptions{Root: f.mpsRoot, Logger: log}), nil
	}
	binary := f.mpsBinary
	if simulated && !f.mpsBinarySet {
		binary = mpsControlSimCommand
	}
	bin, args, err := mpsProgram(binary)
	if err != nil {
		return nil, err
	}
	if args != nil {
		log.Info("MPS daemons are gpu-agent's stand-in", "mps-control", bin+" "+strings.Join(args, " "), "mps-root", f.mpsRoot)
	}
	return mps.NewSupervisor(mps.Options{Binary: bin, Args: args, Root: f.mpsRoot, Logger: log}), nil
}

// mpsProgram is the MPS control program --mps-binary names, and the
// arguments that come before its own. The name mps-control-sim
// (mpsControlSimCommand) is gpu-agent's own stand-in, for a simulated node,
// which has no CUDA to run the real one: run picks it there by itself,
// and mps-host, which does not know what node it is on, is told so.
func mpsProgram(binary string) (string, []string, error) {
	if binary != mpsControlSimCommand {
		return binary, nil, nil
	}
	self, err := os.Executable()
	if err != nil {
		return "", nil, fmt.Errorf("mps stand-in (--mps-binary=%s): %w", mpsControlSimCommand, err)
	}
	return self, []string{mpsControlSimCommand}, nil
}

// registerMPSHostFlag adds `run --mps-host` [GPU_AGENT_MPS_HOST] to fs.
func registerMPSHostFlag(fs *flag.FlagSet, p *bool) error {
	return registerBoolFlag(fs, p, "mps-host", "GPU_AGENT_MPS_HOST",
		"MPS daemons are run by gpu-agent mps-host (its own DaemonSet), asked for through the MPS root, so that they and their clients outlive this agent's container")
}

// registerBoolFlag adds a boolean flag whose default comes from env.
func registerBoolFlag(fs *flag.FlagSet, p *bool, name, env, help string) error {
	def := false
	if v := envDefault(env, ""); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return usageError{fmt.Sprintf("%s %q: want true or false", env, v)}
		}
		def = b
	}
	fs.BoolVar(p, name, def, fmt.Sprintf("%s [%s]", help, env))
	return nil
}
