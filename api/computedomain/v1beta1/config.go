package v1beta1

import (
	"bytes"
	"errors"
	"fmt"

	kjson "sigs.k8s.io/json"
)

// MaxConfigBytes bounds an opaque config: NVIDIA's are a few hundred
// bytes, and the bytes come from any user who can write a claim.
const MaxConfigBytes = 16 << 10

// ComputeDomainChannelConfig is the opaque config of a channel claim
// (DeviceClass compute-domain-default-channel.nvidia.com): which domain
// the channel is of, and how many channels the claim gets.
type ComputeDomainChannelConfig struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	// DomainID is the ComputeDomain's UID; required.
	DomainID string `json:"domainID"`
	// AllocationMode is Single (default) or All.
	AllocationMode AllocationMode `json:"allocationMode,omitempty"`
}

// ComputeDomainDaemonConfig is the opaque config of an IMEX daemon's
// claim (DeviceClass compute-domain-daemon.nvidia.com).
type ComputeDomainDaemonConfig struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	// DomainID is the ComputeDomain's UID; required.
	DomainID string `json:"domainID"`
}

// maxDomainIDBytes bounds a domain id: a UID is 36 bytes; NVIDIA's API
// sets no limit, this guards the names and paths it goes into.
const maxDomainIDBytes = 253

// DecodeConfig reads one opaque config of the compute-domain.nvidia.com
// driver strictly: apiVersion must be resource.nvidia.com/v1beta1, kind
// one of the two above, and unknown or duplicate fields, a missing
// domainID or an allocation mode NVIDIA's API does not define are
// refused, the error naming the field. It returns a
// *ComputeDomainChannelConfig or a *ComputeDomainDaemonConfig, defaults
// filled in.
func DecodeConfig(raw []byte) (any, error) {
	if len(raw) > MaxConfigBytes {
		return nil, fmt.Errorf("%d bytes: above the %d a config may have", len(raw), MaxConfigBytes)
	}
	var tm struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := kjson.UnmarshalCaseSensitivePreserveInts(raw, &tm); err != nil {
		return nil, fmt.Errorf("not a JSON object: %w", err)
	}
	if tm.APIVersion != APIVersion {
		return nil, fmt.Errorf("apiVersion %q: want %s", tm.APIVersion, APIVersion)
	}
	switch tm.Kind {
	case KindComputeDomainChannelConfig:
		var c ComputeDomainChannelConfig
		if err := strict(raw, &c); err != nil {
			return nil, fmt.Errorf("kind %s: %w", tm.Kind, err)
		}
		if err := checkDomainID(c.DomainID); err != nil {
			return nil, fmt.Errorf("kind %s: %w", tm.Kind, err)
		}
		if err := c.AllocationMode.validate(); err != nil {
			return nil, fmt.Errorf("kind %s: %w", tm.Kind, err)
		}
		if c.AllocationMode == "" {
			c.AllocationMode = AllocationModeSingle
		}
		return &c, nil
	case KindComputeDomainDaemonConfig:
		var c ComputeDomainDaemonConfig
		if err := strict(raw, &c); err != nil {
			return nil, fmt.Errorf("kind %s: %w", tm.Kind, err)
		}
		if err := checkDomainID(c.DomainID); err != nil {
			return nil, fmt.Errorf("kind %s: %w", tm.Kind, err)
		}
		return &c, nil
	}
	return nil, fmt.Errorf("kind %q: want %s or %s", tm.Kind, KindComputeDomainChannelConfig, KindComputeDomainDaemonConfig)
}

func checkDomainID(id string) error {
	switch {
	case id == "":
		return errors.New("domainID: required")
	case len(id) > maxDomainIDBytes:
		return fmt.Errorf("domainID: %d bytes, at most %d", len(id), maxDomainIDBytes)
	}
	return nil
}

// strict decodes raw into v, refusing unknown and duplicate fields; field
// names match case-sensitively, as the API server's decoder does.
func strict(raw []byte, v any) error {
	strictErrs, err := kjson.UnmarshalStrict(bytes.TrimSpace(raw), v)
	if err != nil {
		return err
	}
	return errors.Join(strictErrs...)
}
