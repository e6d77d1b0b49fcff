package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/dra/schedsim"
)

// claimFiles is config validate's --claims, given once per file.
type claimFiles []string

func (c *claimFiles) String() string { return strings.Join(*c, ",") }

func (c *claimFiles) Set(v string) error {
	if v == "" {
		return errors.New("empty path")
	}
	*c = append(*c, v)
	return nil
}

// readClaimFiles reads every --claims file ("-": standard input, once).
func readClaimFiles(paths []string, stdin io.Reader) (schedsim.Objects, error) {
	var all schedsim.Objects
	readStdin := false
	for _, p := range paths {
		var r io.Reader
		name := p
		if p == "-" {
			if readStdin {
				return all, errors.New("--claims -: standard input given twice")
			}
			readStdin, r, name = true, stdin, "standard input"
		} else {
			f, err := os.Open(p)
			if err != nil {
				return all, fmt.Errorf("--claims: %w", err)
			}
			defer f.Close()
			r = f
		}
		objs, err := schedsim.Read(r, name)
		if err != nil {
			return all, fmt.Errorf("--claims: %w", err)
		}
		all.Classes = append(all.Classes, objs.Classes...)
		all.Claims = append(all.Claims, objs.Claims...)
		all.Skipped += objs.Skipped
	}
	return all, nil
}

// claimOutcome is what allocating one claim alone on the node gave.
type claimOutcome struct {
	claim   schedsim.Claim
	devices []string // request: device, where it allocates
	misfit  bool     // it does not fit the node
	err     error    // it cannot be evaluated against the node's devices
}

// checkClaims allocates each claim alone on the node as pool would publish
// it, with the kube-scheduler's own allocator and the given DeviceClasses
// (later ones of a name over earlier ones).
func checkClaims(ctx context.Context, nodeName string, pool *devicemodel.Pool, objs schedsim.Objects) []claimOutcome {
	byName := map[string]*resourceapi.DeviceClass{}
	for _, c := range objs.Classes {
		byName[c.Name] = c
	}
	classes := make([]*resourceapi.DeviceClass, 0, len(byName))
	for _, c := range byName {
		classes = append(classes, c)
	}
	node := schedsim.New(nodeName, devicemodel.DriverName, devicemodel.Resources(nodeName, pool, 1, devicemodel.Dropped{}), classes)
	out := make([]claimOutcome, 0, len(objs.Claims))
	for _, c := range objs.Claims {
		o := claimOutcome{claim: c}
		claim := c.Claim.DeepCopy()
		schedsim.Default(claim)
		if missing := missingClasses(claim, byName); len(missing) > 0 {
			o.err = fmt.Errorf("DeviceClass %s not given: add the cluster's (kubectl get deviceclasses -o yaml) or gpu-agent's (deploy/manifests/dra/deviceclasses.yaml) with another --claims", strings.Join(missing, ", "))
			out = append(out, o)
			continue
		}
		results, err := node.Allocate(ctx, claim)
		node.Release()
		switch {
		case errors.Is(err, schedsim.ErrUnsatisfiable):
			o.misfit = true
		case err != nil:
			o.err = err
		default:
			for _, r := range results {
				for _, d := range r.Devices.Results {
					o.devices = append(o.devices, d.Request+": "+d.Device)
				}
			}
		}
		out = append(out, o)
	}
	return out
}

// missingClasses are the DeviceClasses claim names that classes lack, sorted.
func missingClasses(claim *resourceapi.ResourceClaim, classes map[string]*resourceapi.DeviceClass) []string {
	var missing []string
	need := func(name string) {
		if _, ok := classes[name]; !ok && name != "" && !slices.Contains(missing, name) {
			missing = append(missing, name)
		}
	}
	for _, r := range claim.Spec.Devices.Requests {
		if r.Exactly != nil {
			need(r.Exactly.DeviceClassName)
		}
		for _, s := range r.FirstAvailable {
			need(s.DeviceClassName)
		}
	}
	slices.Sort(missing)
	return missing
}

// writeClaims prints each claim's outcome; a claim that cannot be evaluated
// is also a warning on stderr (counted in the return), because it fails on
// every node of this config: most often a selector reading an attribute the
// devices do not carry (dra.migDeviceAttributes). A claim that does not fit
// is not: it may fit another node.
func writeClaims(stdout, stderr io.Writer, file, nodeName string, objs schedsim.Objects, outcomes []claimOutcome) int {
	fmt.Fprintf(stdout, "Claims (--claims: %d %s, %d %s", len(objs.Claims), plural(len(objs.Claims), "claim", "claims"), len(objs.Classes), plural(len(objs.Classes), "DeviceClass", "DeviceClasses"))
	if objs.Skipped > 0 {
		fmt.Fprintf(stdout, ", %d other %s not read", objs.Skipped, plural(objs.Skipped, "object", "objects"))
	}
	fmt.Fprintln(stdout, "), each allocated alone on this node by the kube-scheduler's allocator:")
	var fit, misfit, broken int
	for _, o := range outcomes {
		switch {
		case o.err != nil:
			broken++
			fmt.Fprintf(stdout, "  %s: CANNOT BE EVALUATED here: %v\n", o.claim, o.err)
			fmt.Fprintf(stderr, "warning: %s: on %s: %s cannot be evaluated against the devices this config publishes: %v\n", file, nodeName, o.claim, o.err)
		case o.misfit:
			misfit++
			fmt.Fprintf(stdout, "  %s: does not fit this node\n", o.claim)
		default:
			fit++
			fmt.Fprintf(stdout, "  %s: allocates %s\n", o.claim, strings.Join(o.devices, ", "))
		}
	}
	fmt.Fprintf(stdout, "  %d %s, %d %s not fit this node, %d cannot be evaluated\n", fit, plural(fit, "allocates", "allocate"), misfit, plural(misfit, "does", "do"), broken)
	return broken
}
